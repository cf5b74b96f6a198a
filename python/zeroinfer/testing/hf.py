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
