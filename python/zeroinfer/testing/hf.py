"""Build HF transformers' DeepseekV4ForCausalLM with exactly our weights: the independent oracle
for the model graph (tests only; transformers is a test dependency)."""

from __future__ import annotations

import torch

from zeroinfer.model.config import ModelConfig


def dequantize_experts(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 -> float32, written here independently of zeroinfer.quant (low nibble = even
    element; value = LUT[nibble] * 2^(scale - 127))."""
    lut = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
    b = blocks.to(torch.int64)
    vals = torch.stack([lut[b & 0xF], lut[b >> 4]], dim=-1).flatten(-2)  # [..., N, K]
    s = torch.exp2(scales.to(torch.float32) - 127).repeat_interleave(32, dim=-1)
    return vals * s


def hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our names -> HF-internal names (identical but for the packed experts)."""
    out = {}
    for name, t in state.items():
        if name.endswith("_scales") or name.startswith("mtp."):  # (HF has no MTP modules)
            continue
        if name.endswith("experts.gate_up_blocks") or name.endswith("experts.down_blocks"):
            base = name[: -len("_blocks")]
            proj = base + "_proj"
            out[proj] = dequantize_experts(t, state[base + "_scales"])
        else:
            out[name] = t
    return out


def hf_model(config: ModelConfig, state: dict[str, torch.Tensor], dtype=torch.float32):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    hf_cfg = DeepseekV4Config(**config.to_hf_dict())
    hf_cfg._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(hf_cfg).to(dtype)
    missing, unexpected = model.load_state_dict(
        {k: v.to(dtype) if v.is_floating_point() else v for k, v in hf_state_dict(state).items()},
        strict=False)
    missing = [m for m in missing if "inv_freq" not in m]
    if missing or unexpected:
        raise AssertionError(f"HF state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model.eval()


def min_selection_margin(run) -> float:
    """Smallest relative gap, over every discrete top-k choice `run()` makes in our graph (the
    learned routers' choice in ops.moe_route, the indexers' top_entries), between the k-th and
    (k+1)-th score. Two correct float32 implementations that sum in different orders can pick
    differently when it is ~1e-5 (seen: an indexer gap of 2e-5 relative flipped one entry; a
    router flip moved 2.5% of an MTP test's logits by up to 0.2), so HF comparisons draw inputs
    whose choices are clear. The graph's own selection functions are wrapped, not torch.topk:
    the routers run in C++ and the indexers' CPU top-k is a Tensor.topk on int64 keys."""
    from zeroinfer import ops
    from zeroinfer.model import attention
    from zeroinfer.reference.moe_route import selection_scores

    margins = [float("inf")]

    def gap(scores: torch.Tensor, k: int) -> None:
        v = scores.float().sort(dim=-1, descending=True).values
        if v.shape[-1] <= k:
            return
        a, b = v[..., k - 1], v[..., k]
        ok = torch.isfinite(a) & torch.isfinite(b)
        if ok.any():
            rel = (a - b).abs() / a.abs().clamp_min(1e-6)
            margins.append(float(rel[ok].min()))

    route, top = ops.moe_route, attention.top_entries

    def route_hook(logits, k, **kw):
        if kw.get("hash_table") is None:  # (hash routing makes no choice)
            gap(selection_scores(logits.float(), kw["bias"].float()), k)
        return route(logits, k, **kw)

    def top_hook(scores, k):
        gap(scores, k)
        return top(scores, k)

    ops.moe_route, attention.top_entries = route_hook, top_hook
    try:
        run()
    finally:
        ops.moe_route, attention.top_entries = route, top
    return min(margins)


def random_tokens(gen: torch.Generator, n: int, vocab: int) -> list[int]:
    """n random token ids in [2, vocab), drawn from gen."""
    return torch.randint(2, vocab, (n,), generator=gen).tolist()


def clear_tokens(gen: torch.Generator, n: int, vocab: int, run_with) -> list[int]:
    """n random token ids in [2, vocab) whose every top-k choice in `run_with(ids)` has a relative
    margin >= 1e-4 (redrawn otherwise; a near-tie in almost every draw would fail the search)."""
    for _ in range(20):
        ids = random_tokens(gen, n, vocab)
        if min_selection_margin(lambda ids=ids: run_with(ids)) >= 1e-4:
            return ids
    raise AssertionError("20 draws in a row had a near-tie top-k choice")
