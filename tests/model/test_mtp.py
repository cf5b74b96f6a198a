"""The multi-token-prediction module (DeepseekV4ForCausalLM.mtp, DeepSeek's reference MTPBlock)
against an oracle built from HF transformers' DeepSeek-V4 modules: HF has no MTP module, so the
oracle runs HF's decoder layer (numbered past the main ones: sliding window, a learned router)
between the projections written here from the reference's equations, and HF's own hyper-head
and RMSNorm classes. The checkpoint round trip of the MTP tensors (native `mtp.{i}.*` names),
and the paged / chained execution against single full runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from zeroinfer.model import load
from zeroinfer.model.config import MOE, SLIDING
from zeroinfer.model.dummy import DUMMY_CONFIGS, random_state_dict
from zeroinfer.model.weights import save_checkpoint
from zeroinfer.testing.hf import clear_tokens, random_tokens

NAMES = sorted(DUMMY_CONFIGS)


def _hf_oracle(name: str, seed: int):
    """(HF model of num_hidden_layers + 1 layers whose last is the MTP block, and a function
    ids -> (main logits [T, V], MTP logits [T - 1, V]))."""
    pytest.importorskip("transformers", minversion="5.23")
    from transformers.masking_utils import create_sliding_window_causal_mask
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4HyperHead,
        DeepseekV4RMSNorm,
    )

    from zeroinfer.testing.hf import hf_model

    cfg = DUMMY_CONFIGS[name]
    L = cfg.num_hidden_layers
    state = random_state_dict(cfg, seed, mtp=True)
    # the MTP block as HF's layer L (the layer numbering past the main ones, as our loader does)
    wide = dataclasses.replace(cfg, num_hidden_layers=L + 1, num_nextn_predict_layers=0,
                               layer_types=cfg.layer_types + (SLIDING,),
                               mlp_layer_types=cfg.mlp_layer_types + (MOE,))
    hf_state = {k: v for k, v in state.items() if not k.startswith("mtp.")}
    hf_state.update({f"model.layers.{L}." + k[len("mtp.0.block."):]: v
                     for k, v in state.items() if k.startswith("mtp.0.block.")})
    hf = hf_model(wide, hf_state)
    own = {k[len("mtp.0."):]: v for k, v in state.items()
           if k.startswith("mtp.0.") and not k.startswith("mtp.0.block.")}
    D, eps = cfg.hidden_size, cfg.rms_norm_eps
    norms = {}
    for n in ("enorm", "hnorm", "norm"):
        norms[n] = DeepseekV4RMSNorm(D, eps=eps)
        norms[n].weight.data.copy_(own[f"{n}.weight"])
    head = DeepseekV4HyperHead(hf.config)
    head.load_state_dict({k[len("hc_head."):]: v for k, v in own.items()
                          if k.startswith("hc_head.")})
    m = hf.model

    def layers(h, ids, pos, chosen):
        mask = create_sliding_window_causal_mask(config=hf.config, inputs_embeds=h[:, :, 0],
                                                 attention_mask=None, cache=None,
                                                 position_ids=pos)
        pe = {k: m.rotary_emb(h[:, :, 0], position_ids=pos, layer_type=k)
              for k in ("main", "compress")}
        for layer in chosen:
            h = layer(h, position_embeddings=pe, position_ids=pos, attention_mask=mask,
                      input_ids=ids, cache=None)
        return h

    @torch.no_grad()
    def run(ids: list[int]):
        t = torch.tensor([ids])
        pos = torch.arange(len(ids))[None]
        e = m.embed_tokens(t)
        h = layers(e.unsqueeze(2).expand(-1, -1, cfg.hc_mult, -1).contiguous(), t, pos,
                   m.layers[:L])
        main = hf.lm_head(m.norm(m.hc_head(h)))[0]
        # MTP at t: the streams at t and token t + 1 (reference: e_proj(enorm(embed)) to
        # every stream + h_proj(hnorm(streams)), the block, hc_head, norm, the shared head)
        x = (F.linear(norms["enorm"](m.embed_tokens(t[:, 1:])), own["e_proj.weight"])
             .unsqueeze(2) + F.linear(norms["hnorm"](h[:, :-1]), own["h_proj.weight"]))
        x = layers(x, t[:, :-1], pos[:, :-1], [m.layers[L]])
        return main.float(), hf.lm_head(norms["norm"](head(x)))[0].float()

    return run


@pytest.mark.parametrize("name", NAMES)
def test_mtp_logits_match_hf_oracle(name, gen):
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    ours = load(f"dummy:{name}", seed=seed, mtp=True)
    run = _hf_oracle(name, seed)
    # past the window (8 / 16): the ring wraps; no near-tied router or indexer choice
    ids = clear_tokens(gen, 40, ours.config.vocab_size,
                       lambda t: (ours.logits(t), ours.mtp_logits(t)))
    main, mtp = run(ids)
    torch.testing.assert_close(ours.logits(ids), main, rtol=0, atol=1e-4)
    got = ours.mtp_logits(ids)
    assert got.shape == (len(ids) - 1, ours.config.vocab_size)
    err = (got - mtp).abs().max().item()
    assert err <= 1e-4, f"{name}: max |MTP logit diff| {err:.2e}"


def test_mtp_paged_chunks_and_chain_equal_full_run(gen):
    """The MTP module over a prompt in random chunks (its own paged window cache) equals the
    teacher-forced full run; a chained draft step (the module's own streams fed back, at the
    next position) equals the full run's over the same inputs."""
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    ours = load("dummy:tiny-yarn", seed=seed, mtp=True)
    ids = random_tokens(gen, 45, ours.config.vocab_size)
    full = ours.mtp_logits(ids)
    r = ours.runner(max_seqs=2, max_len=64)
    streams: dict[int, torch.Tensor] = {}
    r.step({1: ids}, streams=streams)
    got, i = [], 0
    outs = []
    while i < len(ids) - 1:
        n = min(int(torch.randint(1, 9, (1,), generator=gen)), len(ids) - 1 - i)
        lg, out = r.mtp_step({1: (streams[1][i:i + n], ids[i + 1:i + 1 + n])})[1]
        got.append(lg)
        outs.append(out)
        i += n
    torch.testing.assert_close(torch.cat(got), full, rtol=0, atol=2e-5)
    # one chained step: the module's output streams at the last position, the next token
    out = torch.cat(outs)
    nxt = int(full[-1].argmax())
    lg, _ = r.mtp_step({1: (out[-1:], [nxt])})[1]
    # the oracle of that step: a fresh runner fed the same inputs in one go
    r2 = ours.runner(max_seqs=1, max_len=64)
    inputs = torch.cat([streams[1][:-1], out[-1:]])
    want, _ = r2.mtp_step({0: (inputs, ids[1:] + [nxt])})[0]
    torch.testing.assert_close(lg, want[-1:], rtol=0, atol=2e-5)


def test_mtp_checkpoint_round_trip(tmp_path, gen):
    """save_checkpoint writes the MTP modules under DeepSeek's native names (FP8 e_proj /
    h_proj and block linears, MXFP4 experts); load(..., mtp=True) reads them back to the same
    dequantized tensors; without mtp they are skipped, as HF does."""
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    ours = load("dummy:tiny", seed=seed, mtp=True)
    path = save_checkpoint(tmp_path / "ckpt", ours, ours.config)
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("mtp.0.e_proj.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor("mtp.0.ffn.experts.3.w1.weight").dtype == torch.int8
    for n in ("mtp.0.e_proj.scale", "mtp.0.h_proj.weight", "mtp.0.enorm.weight",
              "mtp.0.hnorm.weight", "mtp.0.norm.weight", "mtp.0.hc_head_fn",
              "mtp.0.attn.wq_a.weight", "mtp.0.attn.attn_sink", "mtp.0.hc_attn_fn",
              "mtp.0.ffn.gate.bias", "mtp.0.ffn.shared_experts.w2.scale"):
        assert n in names, n
    orig, back = ours.net.state_dict(), load(path, mtp=True).net.state_dict()
    mtp_names = [k for k in orig if k.startswith("mtp.")]
    assert mtp_names and sorted(mtp_names) == sorted(k for k in back if k.startswith("mtp."))
    for k in mtp_names:  # MXFP4 bytes as they were; FP8 / BF16 within their rounding
        a, b = orig[k], back[k]
        if not a.is_floating_point():
            assert torch.equal(a, b), k
        else:
            torch.testing.assert_close(b, a, rtol=0, atol=0.07 * a.abs().max().item(), msg=k)
    with safe_open(str(path / "model.safetensors"), "pt") as f:  # one FP8 tensor exactly
        q, sc = f.get_tensor("mtp.0.e_proj.weight"), f.get_tensor("mtp.0.e_proj.scale")
    tiles = sc.float().repeat_interleave(128, 0).repeat_interleave(128, 1)
    want = q.float() * tiles[:q.shape[0], :q.shape[1]]
    assert torch.equal(back["mtp.0.e_proj.weight"], want)
    assert not [k for k in load(path).net.state_dict() if k.startswith("mtp.")]


def test_mtp_checkpoint_errors(tmp_path, gen):
    """A missing MTP tensor is named by its checkpoint name; a model without MTP modules
    refuses mtp=True."""
    from safetensors.torch import load_file, save_file

    ours = load("dummy:tiny", seed=int(torch.randint(0, 2**31, (1,), generator=gen)), mtp=True)
    path = save_checkpoint(tmp_path / "ckpt", ours, ours.config)
    files = load_file(str(path / "model.safetensors"))
    del files["mtp.0.attn.wq_b.weight"], files["mtp.0.attn.wq_b.scale"]
    save_file(files, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"mtp\.0\.attn\.wq_b\.weight"):
        load(path, mtp=True)
    load(path)  # (without the MTP modules the checkpoint is whole)
    plain = dataclasses.replace(ours.config, num_nextn_predict_layers=0)
    save_checkpoint(tmp_path / "plain", ours.net.state_dict(), plain)
    with pytest.raises(ValueError, match="no MTP modules"):
        load(tmp_path / "plain", mtp=True)


def test_mtp_checkpoint_for_an_expert_parallel_rank(tmp_path, gen):
    """An expert-parallel rank reads its slots of the main layers' experts and every expert of
    the MTP module (held whole on each rank, so drafting needs no exchange)."""
    from zeroinfer.model.weights import iter_checkpoint

    ours = load("dummy:tiny", seed=int(torch.randint(0, 2**31, (1,), generator=gen)), mtp=True)
    path = save_checkpoint(tmp_path / "ckpt", ours, ours.config)
    c = ours.config
    slots = torch.randint(0, c.n_routed_experts, (c.num_hidden_layers, 3), generator=gen)
    got = dict(iter_checkpoint(path, mtp=True, experts=slots))
    full = ours.net.state_dict()
    for layer in range(c.num_hidden_layers):
        name = f"model.layers.{layer}.mlp.experts.gate_up_blocks"
        assert torch.equal(got[name], full[name][slots[layer]])
    name = "mtp.0.block.mlp.experts.down_scales"
    assert got[name].shape[0] == c.n_routed_experts and torch.equal(got[name], full[name])
