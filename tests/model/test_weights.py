"""Checkpoint loader and writer (zeroinfer.model.weights): the real V4-Flash native layout
(FP8 linears with 128x128 UE8M0 scales, MXFP4 experts, BF16/FP32 tensors), the HF-internal and
HF "reverse" hybrid layouts, sharding, alternative storage dtypes, and an error that names the
culprit for every kind of damage. Fresh random weights every run (see conftest.py)."""

from __future__ import annotations

import copy
import json
import math
import os
import re
import secrets
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from zeroinfer.model import ModelConfig, load
from zeroinfer.model.config import CSA, HCA, SLIDING
from zeroinfer.model.dummy import DUMMY_CONFIGS, random_state_dict
from zeroinfer.model.weights import (FP8_QUANTIZATION_CONFIG, dequantized_state, from_hf_name,
                                     iter_checkpoint, save_checkpoint, to_hf_name)

CFG = DUMMY_CONFIGS["tiny"]
ERRORS = (ValueError, TypeError, FileNotFoundError)


# ---------------------------------------------------------------- independent reference math

LUT = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6],
                   dtype=torch.float64)


def ref_ue8m0(b: torch.Tensor) -> torch.Tensor:
    return torch.pow(2.0, b.view(torch.uint8).double() - 127)


def ref_fp8(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Tile-by-tile W = q * scale (scale UE8M0 bytes or float32), in float64."""
    qf = q.view(torch.float8_e4m3fn).double() if q.element_size() == 1 else q.double()
    sf = s.double() if s.dtype == torch.float32 else ref_ue8m0(s)
    out = torch.empty_like(qf)
    for i in range(sf.shape[0]):
        for j in range(sf.shape[1]):
            out[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = \
                qf[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] * sf[i, j]
    return out


def ref_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    b = blocks.view(torch.uint8).long()
    v = torch.stack([LUT[b & 15], LUT[b >> 4]], -1).flatten(-2)
    return v * ref_ue8m0(scales).repeat_interleave(32, -1)


FP8_NATIVE = re.compile(r"^layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)"
                        r"|ffn\.shared_experts\.w[123])\.weight$")
BF16_NATIVE = re.compile(r"^(embed|head)\.weight$|^layers\.\d+\.(ffn\.gate\.weight|"
                         r"attn\.(indexer\.)?compressor\.(wkv|wgate)\.weight|"
                         r"attn\.indexer\.weights_proj\.weight)$")


def expected_params(state: dict, files: dict) -> dict[str, torch.Tensor]:
    """What loading the native file written from `state` must give, from the file itself:
    FP8 linears = q*scale, BF16 = the bf16-rounded originals, the rest unchanged."""
    out = {}
    for name, t in state.items():
        native = None if ".mlp.experts." in name else from_hf_name(name, "native")
        if native is not None and FP8_NATIVE.match(native):
            out[name] = ref_fp8(files[native], files[native[:-len("weight")] + "scale"]).float()
        elif native is not None and BF16_NATIVE.match(native):
            out[name] = t.to(torch.bfloat16).float()
        else:
            out[name] = t
    return out


def assert_state_equal(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), f"{what}: names differ: {sorted(set(got) ^ set(want))[:5]}"
    for k in want:
        g, w = got[k], want[k]
        assert g.shape == w.shape, f"{what}: {k} shape {tuple(g.shape)} != {tuple(w.shape)}"
        if w.is_floating_point():
            err = (g.float() - w.float()).abs().max()
            assert torch.equal(g.float(), w.float()), f"{what}: {k} differs (max {err})"
        else:
            assert torch.equal(g.to(w.dtype), w), f"{what}: {k} differs"


def assert_same_values(want: dict, got: dict) -> None:
    """Equal parameters, the packed experts compared by value (re-quantization may pick other
    bytes for the same numbers: -0 nibbles, scales of all-zero groups)."""
    assert set(got) == set(want)
    for k, t in want.items():
        if k.endswith("_blocks"):
            base = k[: -len("_blocks")]
            assert torch.equal(ref_mxfp4(got[k], got[base + "_scales"]),
                               ref_mxfp4(t, want[base + "_scales"])), k
        elif not k.endswith("_scales"):
            assert torch.equal(got[k], t), k


def stacked_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked expert weights [E, N, K] as FP8 e4m3 with one power-of-two float32 scale per
    128x128 tile (HF's quantizer layout): (q, scale_inv)."""
    w = w.double()
    E, N, K = w.shape
    tiles = w.abs().reshape(E, math.ceil(N / 128), 128, math.ceil(K / 128), min(K, 128))
    s = torch.pow(2.0, torch.ceil(torch.log2(tiles.amax(dim=(2, 4)) / 448)))
    sf = s.repeat_interleave(128, 1)[:, :N].repeat_interleave(128, 2)[:, :, :K]
    return (w / sf).float().to(torch.float8_e4m3fn), s.float()


def params_of(path) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in load(path).net.state_dict().items()}


def random_seed(gen) -> int:
    return int(torch.randint(0, 2**31 - 1, (1,), generator=gen))


def write_native(tmp_path, gen, cfg=CFG, **kw):
    state = random_state_dict(cfg, random_seed(gen))
    path = save_checkpoint(tmp_path / "ckpt", state, cfg, **kw)
    return state, path


def read_all(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


# ---------------------------------------------------------------- names


def test_name_rules_match_the_reference_table():
    pairs = {  # from the checkpoint-format reference (conversion_mapping.py)
        "embed.weight": "model.embed_tokens.weight",
        "head.weight": "lm_head.weight",
        "norm.weight": "model.norm.weight",
        "hc_head_fn": "model.hc_head.hc_fn",
        "hc_head_scale": "model.hc_head.hc_scale",
        "layers.0.hc_attn_fn": "model.layers.0.attn_hc.fn",
        "layers.0.hc_ffn_scale": "model.layers.0.ffn_hc.scale",
        "layers.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
        "layers.0.ffn_norm.weight": "model.layers.0.post_attention_layernorm.weight",
        "layers.3.attn.wq_a.weight": "model.layers.3.self_attn.q_a_proj.weight",
        "layers.3.attn.q_norm.weight": "model.layers.3.self_attn.q_a_norm.weight",
        "layers.3.attn.wq_b.weight": "model.layers.3.self_attn.q_b_proj.weight",
        "layers.3.attn.wkv.weight": "model.layers.3.self_attn.kv_proj.weight",
        "layers.3.attn.norm.weight": "model.layers.3.self_attn.kv_norm.weight",
        "layers.3.attn.wo_a.weight": "model.layers.3.self_attn.o_a_proj.weight",
        "layers.3.attn.wo_b.weight": "model.layers.3.self_attn.o_b_proj.weight",
        "layers.3.attn.attn_sink": "model.layers.3.self_attn.sinks",
        "layers.3.attn.compressor.wkv.weight": "model.layers.3.self_attn.compressor.kv_proj.weight",
        "layers.3.attn.compressor.wgate.weight": "model.layers.3.self_attn.compressor.gate_proj.weight",
        "layers.3.attn.compressor.ape": "model.layers.3.self_attn.compressor.position_bias",
        "layers.3.attn.compressor.norm.weight": "model.layers.3.self_attn.compressor.kv_norm.weight",
        "layers.3.attn.indexer.compressor.wkv.weight":
            "model.layers.3.self_attn.compressor.indexer.kv_proj.weight",
        "layers.3.attn.indexer.compressor.ape": "model.layers.3.self_attn.compressor.indexer.position_bias",
        "layers.3.attn.indexer.compressor.norm.weight":
            "model.layers.3.self_attn.compressor.indexer.kv_norm.weight",
        "layers.3.attn.indexer.wq_b.weight": "model.layers.3.self_attn.compressor.indexer.q_b_proj.weight",
        "layers.3.attn.indexer.weights_proj.weight":
            "model.layers.3.self_attn.compressor.indexer.scorer.weights_proj.weight",
        "layers.3.ffn.gate.weight": "model.layers.3.mlp.gate.weight",
        "layers.3.ffn.gate.bias": "model.layers.3.mlp.gate.e_score_correction_bias",
        "layers.0.ffn.gate.tid2eid": "model.layers.0.mlp.gate.tid2eid",
        "layers.3.ffn.shared_experts.w1.weight": "model.layers.3.mlp.shared_experts.gate_proj.weight",
        "layers.3.ffn.shared_experts.w2.weight": "model.layers.3.mlp.shared_experts.down_proj.weight",
        "layers.3.ffn.shared_experts.w3.weight": "model.layers.3.mlp.shared_experts.up_proj.weight",
    }
    for native, hf in pairs.items():
        assert to_hf_name(native) == hf, native
        assert to_hf_name(hf) == hf, hf
        assert from_hf_name(hf, "native") == native, hf
    assert from_hf_name("model.layers.3.self_attn.q_a_proj.weight", "hybrid") == \
        "model.layers.3.attn.wq_a.weight"
    assert from_hf_name("model.embed_tokens.weight", "hybrid") == "model.embed_tokens.weight"
    assert from_hf_name("model.hc_head.hc_fn", "hybrid") == "model.hc_head.hc_fn"
    assert from_hf_name("lm_head.weight", "hybrid") == "head.weight"
    assert to_hf_name("mtp.0.attn.wq_a.weight") is None
    assert to_hf_name("model.mtp.1.ffn.experts.0.w1.weight") is None


@pytest.mark.parametrize("name", sorted(DUMMY_CONFIGS))
def test_every_parameter_round_trips_through_every_layout(name):
    cfg = DUMMY_CONFIGS[name]
    from zeroinfer.model.deepseek_v4 import DeepseekV4ForCausalLM

    with torch.device("meta"):
        params = DeepseekV4ForCausalLM(cfg).state_dict()
    for p in params:
        if "mlp.experts." in p:
            continue
        assert to_hf_name(p) == p
        for layout in ("native", "hybrid"):
            assert to_hf_name(from_hf_name(p, layout)) == p, (p, layout)


# ---------------------------------------------------------------- native FP8 layout


@pytest.mark.parametrize("shard", [None, 300_000], ids=["single", "sharded"])
def test_native_fp8_checkpoint_loads_the_dequantized_values(tmp_path, gen, shard):
    state, path = write_native(tmp_path, gen, max_shard_bytes=shard)
    if shard:
        shards = sorted(path.glob("model-*-of-*.safetensors"))
        assert len(shards) > 2 and (path / "model.safetensors.index.json").is_file()
        assert not (path / "model.safetensors").exists()
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"].values()) == {f.name for f in shards}
    files = read_all(path)
    cfg_json = json.loads((path / "config.json").read_text())
    assert cfg_json["quantization_config"] == FP8_QUANTIZATION_CONFIG
    assert ModelConfig.from_pretrained(path) == CFG

    # on-disk formats of the real V4-Flash checkpoint
    for k, t in files.items():
        if k.endswith(".scale") and ".experts." in k:
            assert t.dtype == torch.float8_e8m0fnu, k
        elif ".experts." in k:
            assert t.dtype == torch.int8, k
        elif FP8_NATIVE.match(k):
            assert t.dtype == torch.float8_e4m3fn, k
            s = files[k[:-len("weight")] + "scale"]
            assert s.dtype == torch.float8_e8m0fnu
            assert tuple(s.shape) == (math.ceil(t.shape[0] / 128), math.ceil(t.shape[1] / 128)), k
        elif k.endswith(".scale"):
            assert FP8_NATIVE.match(k[:-len("scale")] + "weight"), k
        elif BF16_NATIVE.match(k):
            assert t.dtype == torch.bfloat16, k
        elif k.endswith("tid2eid"):
            assert t.dtype == torch.int64, k
        else:
            assert t.dtype == torch.float32, k
    n_fp8 = sum(bool(FP8_NATIVE.match(k)) for k in files)
    assert n_fp8 == CFG.num_hidden_layers * 8 + CFG.layer_types.count(CSA)

    # FP8 scales: 2^ceil(log2(amax/448)) per tile
    for k in files:
        if FP8_NATIVE.match(k):
            w = state[to_hf_name(k)].double()
            s = ref_ue8m0(files[k[:-len("weight")] + "scale"])
            for i in range(s.shape[0]):
                for j in range(s.shape[1]):
                    amax = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].abs().max().item()
                    assert s[i, j].item() == 2.0 ** math.ceil(math.log2(amax / 448)), k

    want = expected_params(state, files)
    got = params_of(path)
    assert_state_equal(got, want, "native FP8")
    # FP8 and BF16 changed the values only by rounding
    for k, t in state.items():
        if t.is_floating_point():
            tol = 2.0 ** -4 * t.abs().max().item()
            assert (got[k] - t).abs().max().item() <= tol, k
    # the experts and the small fp32 tensors are untouched
    for k in ("model.layers.2.mlp.experts.gate_up_blocks", "model.layers.2.mlp.experts.down_scales",
              "model.layers.0.mlp.gate.tid2eid", "model.hc_head.hc_fn",
              "model.layers.1.self_attn.compressor.position_bias"):
        assert torch.equal(got[k], state[k]), k


def test_zero_tile_gets_a_finite_scale(tmp_path, gen):
    state = random_state_dict(CFG, random_seed(gen))
    state["model.layers.0.self_attn.q_b_proj.weight"][128:256] = 0
    path = save_checkpoint(tmp_path / "z", state, CFG)
    files = read_all(path)
    s = files["layers.0.attn.wq_b.scale"].view(torch.uint8)
    assert s[1, 0] != 255 and torch.isfinite(ref_ue8m0(s)).all()
    assert torch.equal(params_of(path)["model.layers.0.self_attn.q_b_proj.weight"][128:256],
                       torch.zeros(128, 32))


def test_hybrid_names_load_identically(tmp_path, gen):
    _, path = write_native(tmp_path, gen)
    files = read_all(path)

    def hybrid(k):  # save_pretrained's default: "model." stays, only head is renamed back
        return {"embed.weight": "model.embed_tokens.weight", "hc_head_fn": "model.hc_head.hc_fn",
                "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale",
                "head.weight": "head.weight"}.get(k, "model." + k)

    renamed = {hybrid(k): v for k, v in files.items()}
    assert "model.layers.3.attn.wq_a.weight" in renamed and "model.embed_tokens.weight" in renamed
    out = tmp_path / "hybrid"
    out.mkdir()
    shutil.copy(path / "config.json", out)
    save_file(renamed, str(out / "model.safetensors"))
    assert_state_equal(params_of(out), params_of(path), "hybrid")
    # the writer's own hybrid layout names the same tensors
    again = save_checkpoint(tmp_path / "hybrid2", load(path).net.state_dict(), CFG, layout="hybrid")
    assert set(read_all(again)) == set(renamed)


def test_hf_internal_layout_loads_identically(tmp_path, gen):
    _, path = write_native(tmp_path, gen)
    native = params_of(path)
    hf = save_checkpoint(tmp_path / "hf", native, CFG, layout="hf")
    files = read_all(hf)
    assert "model.layers.1.mlp.experts.gate_up_proj" in files
    assert files["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 128, 64)
    assert all(t.dtype in (torch.float32, torch.int64) for t in files.values())
    got = params_of(hf)
    assert_same_values(native, got)
    # non-quantized native names (fp8=False) load the same too
    dense = save_checkpoint(tmp_path / "dense", native, CFG, layout="native", fp8=False)
    assert "quantization_config" not in json.loads((dense / "config.json").read_text())
    d = params_of(dense)
    assert all(torch.equal(d[k], got[k]) for k in got)


def test_hf_internal_quantized_experts_and_our_own_names(tmp_path, gen):
    """HF-internal names with FP8 linears + `.weight_scale_inv`, stacked experts as FP8 +
    `_scale_inv` tiles or as packed MXFP4 + `_scale_inv`, and a plain dump of our own parameter
    names, all load the same parameters."""
    _, path = write_native(tmp_path, gen)
    want = params_of(path)
    hf = save_checkpoint(tmp_path / "hf", want, CFG, layout="hf")
    files = read_all(hf)
    native = read_all(path)
    for k, t in native.items():  # FP8 linears as HF's quantizer names them
        if FP8_NATIVE.match(k):
            files[to_hf_name(k)] = t
            files[to_hf_name(k) + "_scale_inv"] = native[k[:-len("weight")] + "scale"]
    assert "model.layers.1.self_attn.q_a_proj.weight_scale_inv" in files
    for L in range(CFG.num_hidden_layers):
        p = f"model.layers.{L}.mlp.experts."
        files[p + "gate_up_proj"], files[p + "gate_up_proj_scale_inv"] = stacked_fp8(
            files[p + "gate_up_proj"])
        files[p + "down_proj"] = want[p + "down_blocks"].view(torch.int8)  # packed MXFP4
        files[p + "down_proj_scale_inv"] = want[p + "down_scales"].view(torch.float8_e8m0fnu)
    save_file(files, str(hf / "model.safetensors"))
    got = params_of(hf)
    assert_same_values(want, got)
    ours = tmp_path / "ours"
    ours.mkdir()
    shutil.copy(path / "config.json", ours)
    save_file(want, str(ours / "model.safetensors"))
    assert_state_equal(params_of(ours), want, "our names")


def test_dense_experts_that_are_not_mxfp4_are_rejected(tmp_path, gen):
    _, path = write_native(tmp_path, gen)
    hf = save_checkpoint(tmp_path / "hf", params_of(path), CFG, layout="hf")
    files = read_all(hf)
    files["model.layers.2.mlp.experts.down_proj"][3, 5, 7] += 1e-3
    save_file(files, str(hf / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts\.down_proj.*"
                       r"dense \(non-MXFP4\) routed experts are not supported"):
        load(hf)


def test_alternative_storage_dtypes(tmp_path, gen):
    """uint8 UE8M0 scales, FP8 as raw bytes, float32 UE8M0-valued scales (Flash-Base style),
    F4 (float4_e2m1fn_x2) experts, int32 tid2eid: same parameters."""
    _, path = write_native(tmp_path, gen)
    want = params_of(path)
    files = read_all(path)
    alt = {}
    flip = 0
    for k, t in files.items():
        if t.dtype == torch.float8_e8m0fnu:
            # alternate uint8 bytes and float32 powers of two
            alt[k] = t.view(torch.uint8) if flip % 2 else ref_ue8m0(t).float()
            flip += 1
        elif t.dtype == torch.float8_e4m3fn:
            alt[k] = t.view(torch.uint8) if flip % 3 else t.view(torch.int8)
        elif t.dtype == torch.int8:
            alt[k] = t.view(torch.float4_e2m1fn_x2) if flip % 2 else t.view(torch.uint8)
        elif t.dtype == torch.int64:
            alt[k] = t.to(torch.int32)
        else:
            alt[k] = t
    out = tmp_path / "alt"
    out.mkdir()
    shutil.copy(path / "config.json", out)
    save_file(alt, str(out / "model.safetensors"))
    got = params_of(out)
    assert_state_equal(got, want, "alternative dtypes")
    assert got["model.layers.0.mlp.gate.tid2eid"].dtype == torch.int64


def test_fp8_experts_with_float32_scales_flash_base_style(tmp_path, gen):
    """Experts as FP8 e4m3 + float32 tile scales (V4-Flash-Base) are re-packed to MXFP4."""
    _, path = write_native(tmp_path, gen)
    want = params_of(path)
    files = read_all(path)
    for k in [k for k in files if re.search(r"experts\.\d+\.w\d\.weight$", k)]:
        w = ref_mxfp4(files[k], files[k[:-len("weight")] + "scale"])
        n, k_ = w.shape
        tiles = w.abs().reshape(math.ceil(n / 128), -1, math.ceil(k_ / 128), min(128, k_))
        amax = tiles.amax(dim=(1, 3))
        s = torch.pow(2.0, torch.ceil(torch.log2(amax / 448)))
        sf = s.repeat_interleave(128, 0)[:w.shape[0]].repeat_interleave(128, 1)[:, :w.shape[1]]
        q = (w / sf).float().to(torch.float8_e4m3fn)
        assert torch.equal(q.double() * sf, w)
        files[k], files[k[:-len("weight")] + "scale"] = q, s.float()
    save_file(files, str(path / "model.safetensors"))
    got = params_of(path)
    assert_same_values(want, got)


@pytest.mark.parametrize("top,inner", [(t, i) for t in (None, "fp4", "fp8")
                                       for i in (None, "fp4", "fp8") if t or i])
def test_expert_dtype_in_config_json(tmp_path, gen, top, inner):
    """V4 configs may give expert_dtype at the top level ("fp4" for Flash, "fp8" for
    Flash-Base; HF copies it into quantization_config unless that has its own, which wins)
    or in quantization_config (V4.1). Either way the checkpoint loads; FP4 experts mean
    expert_dtype "fp4", any other "dense" (re-packed to MXFP4 if exactly representable)."""
    state, path = write_native(tmp_path, gen)
    d = json.loads((path / "config.json").read_text())
    d["quantization_config"].pop("expert_dtype")
    if top:
        d["expert_dtype"] = top
    if inner:
        d["quantization_config"]["expert_dtype"] = inner
    (path / "config.json").write_text(json.dumps(d))
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.expert_dtype == ("fp4" if (inner or top) == "fp4" else "dense")
    assert_state_equal(params_of(path), dequantized_state(path), f"{top} / {inner}")


def test_dequantization_matches_transformers(tmp_path, gen):
    """HF's own FP8/FP4 dequantization (Fp8Dequantize) of every scaled tensor in our file
    gives exactly the parameters we load."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    _, path = write_native(tmp_path, gen)
    files = read_all(path)
    got = params_of(path)
    deq = fp8.Fp8Dequantize(None)
    for k, t in files.items():
        if not k.endswith(".weight") or k[:-len("weight")] + "scale" not in files:
            continue
        h = deq._dequantize_one(t, files[k[:-len("weight")] + "scale"], output_dtype=torch.float32)
        m = re.match(r"layers\.(\d+)\.ffn\.experts\.(\d+)\.(w\d)\.weight", k)
        if m:
            L, e, w = int(m[1]), int(m[2]), m[3]
            p = f"model.layers.{L}.mlp.experts.{'down' if w == 'w2' else 'gate_up'}"
            ours = ref_mxfp4(got[p + "_blocks"][e], got[p + "_scales"][e]).float()
            I = CFG.moe_intermediate_size
            ours = {"w1": ours[:I], "w3": ours[I:], "w2": ours}[w]
        else:
            ours = got[to_hf_name(k)]
        assert torch.equal(h, ours), k


@pytest.mark.parametrize("layout", ["native", "hybrid", "hf"])
def test_tied_word_embeddings(tmp_path, gen, layout):
    """With tie_word_embeddings, HF's save_pretrained leaves the LM head out and HF's
    DeepseekV4ForCausalLM ties it to the embedding: the head is the embedding. A head that
    the checkpoint does hold is loaded as it is (HF unties what the file gives twice)."""
    _, native = write_native(tmp_path, gen)
    want = params_of(native)
    path = save_checkpoint(tmp_path / layout, want, CFG, layout=layout)
    files = read_all(path)
    head = "lm_head.weight" if layout == "hf" else "head.weight"
    embed = "embed.weight" if layout == "native" else "model.embed_tokens.weight"
    kept = files.pop(head)
    d = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**d, "tie_word_embeddings": True}))
    save_file(files, str(path / "model.safetensors"))
    got = params_of(path)
    assert torch.equal(got["lm_head.weight"], files[embed].float())
    assert_same_values({k: t for k, t in want.items() if k != "lm_head.weight"},
                       {k: t for k, t in got.items() if k != "lm_head.weight"})
    save_file({**files, head: kept}, str(path / "model.safetensors"))
    assert torch.equal(params_of(path)["lm_head.weight"], kept.float())
    (path / "config.json").write_text(json.dumps(d))  # untied: the head is missing
    save_file(files, str(path / "model.safetensors"))
    _expect_error_naming(path, head)


def test_mtp_tensors_are_ignored_and_dequantized_state(tmp_path, gen):
    _, path = write_native(tmp_path, gen)
    files = read_all(path)
    files["mtp.0.attn.wq_a.weight"] = files["layers.0.attn.wq_a.weight"].clone()
    files["mtp.0.attn.wq_a.scale"] = files["layers.0.attn.wq_a.scale"].clone()
    files["mtp.0.emb.tok_emb.weight"] = torch.zeros(3)
    out = tmp_path / "mtp"
    out.mkdir()
    shutil.copy(path / "config.json", out)
    save_file(files, str(out / "model.safetensors"))
    assert_state_equal(dequantized_state(out), dequantized_state(path), "mtp")


def legacy_dict(cfg: ModelConfig) -> dict:
    """cfg's config.json in the legacy DeepSeek keys (compress_ratios, num_hash_layers,
    qk_rope_head_dim, rope_scaling with yarn, compress_rate_*)."""
    legacy = {k: v for k, v in cfg.to_hf_dict().items() if k not in (
        "layer_types", "mlp_layer_types", "compress_rates", "rope_parameters",
        "partial_rotary_factor")}
    ratio = {SLIDING: 0, CSA: 4, HCA: 128}
    legacy.update(compress_ratios=[ratio[t] for t in cfg.layer_types],
                  compress_rate_csa=cfg.csa_rate, compress_rate_hca=cfg.hca_rate,
                  num_hash_layers=cfg.mlp_layer_types.count("hash_moe"),
                  qk_rope_head_dim=64, rope_theta=cfg.rope_theta,
                  compress_rope_theta=cfg.compress_rope_theta,
                  quantization_config=dict(FP8_QUANTIZATION_CONFIG))
    if cfg.compress_yarn is not None:
        y = cfg.compress_yarn
        legacy["rope_scaling"] = {"type": "yarn", "factor": y.factor, "beta_fast": y.beta_fast,
                                  "beta_slow": y.beta_slow,
                                  "original_max_position_embeddings":
                                      y.original_max_position_embeddings}
    return legacy


@pytest.mark.parametrize("name", sorted(DUMMY_CONFIGS))
def test_legacy_config_keys_give_the_same_config(tmp_path, gen, name):
    cfg = DUMMY_CONFIGS[name]
    legacy = legacy_dict(cfg)
    assert ModelConfig.from_hf_dict(legacy) == cfg
    transformers = pytest.importorskip("transformers")
    hf = transformers.DeepseekV4Config(**copy.deepcopy(legacy))  # HF's reading of the same keys
    assert list(hf.layer_types) == list(cfg.layer_types)
    assert list(hf.mlp_layer_types) == list(cfg.mlp_layer_types)
    assert hf.compress_rates == {CSA: cfg.csa_rate, HCA: cfg.hca_rate}
    assert hf.qk_rope_head_dim == 64
    compress = hf.rope_parameters["compress"]
    assert compress["rope_theta"] == cfg.compress_rope_theta
    assert compress["rope_type"] == ("yarn" if cfg.compress_yarn else "default")
    if cfg.compress_yarn:
        assert compress["factor"] == cfg.compress_yarn.factor
    # and a checkpoint whose config.json uses them loads with that config
    state, path = write_native(tmp_path, gen, cfg=cfg)
    (path / "config.json").write_text(json.dumps(legacy))
    m = load(path)
    assert m.config == cfg


def _rope_forms(gen, cfg: ModelConfig) -> dict[str, dict]:
    """cfg's config.json with random YaRN parameters on the compress table, in every form
    config.json gives them: legacy flat `rope_scaling` (with or without
    original_max_position_embeddings, or a rope_theta of its own), transformers 5's flat
    `rope_parameters`, and HF's nested {"main", "compress"}."""
    def draw(lo, hi):
        return float(torch.randint(lo, hi, (1,), generator=gen))

    base = {k: v for k, v in cfg.to_hf_dict().items() if k != "rope_parameters"}
    base.update(rope_theta=draw(1, 50) * 1000, compress_rope_theta=draw(50, 400) * 1000,
                max_position_embeddings=int(2 ** draw(14, 21)))
    yarn = {"factor": 2 ** draw(1, 6), "original_max_position_embeddings": int(2 ** draw(6, 13)),
            "beta_fast": draw(16, 48), "beta_slow": draw(1, 3)}
    main = {"rope_type": "default", "rope_theta": base["rope_theta"],
            "partial_rotary_factor": 0.125}
    compress = {"rope_type": "yarn", "rope_theta": base["compress_rope_theta"],
                "partial_rotary_factor": 0.125, **yarn}
    no_orig = {k: v for k, v in yarn.items() if k != "original_max_position_embeddings"}
    return {
        "rope_scaling": {**base, "rope_scaling": {"type": "yarn", **yarn}},
        "rope_scaling without original_max": {**base, "rope_scaling": {"type": "yarn", **no_orig}},
        "rope_scaling with a rope_theta": {**base, "rope_scaling": {
            "type": "yarn", "rope_theta": base["rope_theta"], **yarn}},
        "flat rope_parameters": {**base, "rope_parameters": {
            "rope_type": "yarn", "rope_theta": base["rope_theta"], **yarn}},
        "nested": {**base, "rope_parameters": {"main": main, "compress": compress}},
        "nested without attention_factor or original_max": {**base, "rope_parameters": {
            "main": main, "compress": {k: v for k, v in compress.items()
                                       if k != "original_max_position_embeddings"}}},
        "nested with attention_factor": {**base, "rope_parameters": {
            "main": main, "compress": {**compress, "attention_factor": 1 + draw(1, 9) / 10}}},
    }


def test_rope_scaling_forms_give_hf_rope_tables(gen):
    """Every form of the YaRN parameters in config.json gives the RoPE tables (inv_freq of
    both tables and the compress table's cos/sin factor) that HF's DeepseekV4RotaryEmbedding
    builds from the same file."""
    transformers = pytest.importorskip("transformers", minversion="5.23")
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    from zeroinfer.model.rope import RopeTables

    for form, d in _rope_forms(gen, DUMMY_CONFIGS["tiny-yarn"]).items():
        ours = RopeTables(ModelConfig.from_hf_dict(copy.deepcopy(d)), torch.device("cpu"))
        hf = DeepseekV4RotaryEmbedding(transformers.DeepseekV4Config(**copy.deepcopy(d)))
        for table in ("main", "compress"):
            want = getattr(hf, f"{table}_inv_freq")
            assert torch.allclose(getattr(ours, table), want, rtol=1e-6, atol=0), (form, table)
            assert ours.scaling[table] == pytest.approx(
                getattr(hf, f"{table}_attention_scaling"), rel=1e-12), (form, table)


# ---------------------------------------------------------------- against HF logits


def indexer_boundary_ties(model, ids) -> int:
    """Queries whose CSA indexer top-k boundary falls inside a tie of exactly equal scores (ReLU
    scores are often exactly 0). Which of the tied entries is chosen is implementation-defined
    (ours: the lowest index, HF's torch.topk: unspecified), so such inputs have no single right
    answer to compare logits on."""
    from zeroinfer import ops

    ties, k = 0, model.config.index_topk
    orig = ops.indexer_scores

    def scores(q, weights, keys, tables, seq, visible, num_entries, **kw):
        nonlocal ties
        sc = orig(q, weights, keys, tables, seq, visible, num_entries, **kw)
        for row, v in zip(sc, visible.tolist()):
            if v > k:
                top = torch.sort(row[:v], descending=True).values
                ties += int(top[k - 1] == top[k])
        return sc

    ops.indexer_scores = scores
    try:
        model.logits(ids)
    finally:
        ops.indexer_scores = orig
    return ties


@pytest.mark.parametrize("name", ["tiny"])  # has every attention and MoE kind
def test_real_format_checkpoint_matches_hf_logits(tmp_path, gen, name):
    """zeroinfer on the native FP8/MXFP4 checkpoint vs HF's DeepseekV4ForCausalLM holding the
    same dequantized weights, float32. Inputs whose indexer choice is a tie (see
    indexer_boundary_ties) are drawn again."""
    pytest.importorskip("transformers", minversion="5.23")
    from zeroinfer.testing.hf import hf_model

    cfg = DUMMY_CONFIGS[name]
    _, path = write_native(tmp_path, gen, cfg=cfg)
    ours = load(path)
    state = dequantized_state(path)
    hf = hf_model(cfg, state)
    for _ in range(50):
        ids = torch.randint(2, cfg.vocab_size, (60,), generator=gen).tolist()
        if not indexer_boundary_ties(ours, ids):
            break
    else:
        pytest.fail("every drawn input had an indexer tie at the top-k boundary")
    got = ours.logits(ids)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float()
    err = (got - want).abs().max().item()
    assert err <= 1e-4, f"max |logit diff| {err:.2e}"


# ---------------------------------------------------------------- damage: every kind of tensor

KINDS = [
    "embed.weight", "head.weight", "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale",
    "layers.N.hc_attn_fn", "layers.N.hc_attn_base", "layers.N.hc_attn_scale",
    "layers.N.hc_ffn_fn", "layers.N.hc_ffn_base", "layers.N.hc_ffn_scale",
    "layers.N.attn_norm.weight", "layers.N.ffn_norm.weight",
    *[f"layers.N.attn.{p}.{s}" for p in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")
      for s in ("weight", "scale")],
    "layers.N.attn.q_norm.weight", "layers.N.attn.norm.weight", "layers.N.attn.attn_sink",
    "layers.N.attn.compressor.wkv.weight", "layers.N.attn.compressor.wgate.weight",
    "layers.N.attn.compressor.ape", "layers.N.attn.compressor.norm.weight",
    "layers.N.attn.indexer.wq_b.weight", "layers.N.attn.indexer.wq_b.scale",
    "layers.N.attn.indexer.weights_proj.weight",
    "layers.N.attn.indexer.compressor.wkv.weight", "layers.N.attn.indexer.compressor.wgate.weight",
    "layers.N.attn.indexer.compressor.ape", "layers.N.attn.indexer.compressor.norm.weight",
    "layers.N.ffn.gate.weight", "layers.N.ffn.gate.bias", "layers.N.ffn.gate.tid2eid",
    *[f"layers.N.ffn.shared_experts.{w}.{s}" for w in ("w1", "w2", "w3")
      for s in ("weight", "scale")],
    *[f"layers.N.ffn.experts.E.{w}.{s}" for w in ("w1", "w2", "w3") for s in ("weight", "scale")],
]


def kind_of(name: str) -> str:
    return re.sub(r"experts\.\d+\.", "experts.E.", re.sub(r"^layers\.\d+\.", "layers.N.", name))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """One native FP8 checkpoint for the damage tests (its own fresh seed, printed)."""
    seed = int(os.environ.get("ZEROINFER_TEST_SEED", secrets.randbits(31)))
    print(f"[test_weights damage base] ZEROINFER_TEST_SEED={seed}")
    path = save_checkpoint(tmp_path_factory.mktemp("base") / "ckpt", random_state_dict(CFG, seed),
                           CFG)
    return path, read_all(path)


def test_damage_kinds_cover_the_whole_checkpoint(base):
    _, files = base
    assert {kind_of(k) for k in files} == set(KINDS)


def _write(tmp_path, base_path, tensors):
    out = tmp_path / "bad"
    out.mkdir()
    shutil.copy(base_path / "config.json", out)
    save_file(tensors, str(out / "model.safetensors"))
    return out


def _expect_error_naming(path, name):
    with pytest.raises(ERRORS) as ei:
        load(path)
    assert name in str(ei.value), f"error does not name {name!r}: {ei.value}"


@pytest.mark.parametrize("damage", ["removed", "renamed", "reshaped", "retyped"])
@pytest.mark.parametrize("kind", KINDS)
def test_damaged_tensor_is_named(base, tmp_path, gen, kind, damage):
    path, files = base
    names = sorted(k for k in files if kind_of(k) == kind)
    victim = names[int(torch.randint(0, len(names), (1,), generator=gen))]
    tensors = dict(files)
    t = tensors.pop(victim)
    named = victim
    if damage == "renamed":
        named = victim + "_renamed"
        tensors[named] = t
    elif damage == "reshaped":
        tensors[victim] = t.reshape(-1) if t.dim() > 1 else t.reshape(1, -1)
    elif damage == "retyped":
        if t.element_size() == 1:
            raw = t.view(torch.uint8)
            tensors[victim] = raw.to(torch.int32 if t.is_floating_point() else torch.float32)
        else:
            tensors[victim] = t.to(torch.int32) if t.is_floating_point() else t.to(torch.float32)
    _expect_error_naming(_write(tmp_path, path, tensors), named)


def test_truncated_and_corrupt_files_are_named(base, tmp_path):
    path, _ = base
    out = tmp_path / "trunc"
    shutil.copytree(path, out)
    f = out / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    _expect_error_naming(out, str(f))
    f.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    _expect_error_naming(out, str(f))
    f.write_bytes(b"")
    _expect_error_naming(out, str(f))


def test_sharded_checkpoint_errors(base, tmp_path, gen):
    _, files = base
    state = random_state_dict(CFG, random_seed(gen))
    path = save_checkpoint(tmp_path / "sh", state, CFG, max_shard_bytes=400_000)
    shards = sorted(path.glob("model-*.safetensors"))
    victim = shards[int(torch.randint(0, len(shards), (1,), generator=gen))]
    victim.rename(tmp_path / "away.safetensors")
    with pytest.raises(FileNotFoundError, match=re.escape(victim.name)):
        load(path)
    (tmp_path / "away.safetensors").rename(victim)
    load(path)
    # the index lists a tensor that its shard does not hold
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["layers.0.attn.ghost.weight"] = shards[0].name
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    _expect_error_naming(path, "layers.0.attn.ghost.weight")


def test_sharded_index_with_a_bad_shard_name_is_named(tmp_path, gen):
    """An index whose weight_map gives a tensor something other than a shard's file name:
    the error names the index and the tensor (not a bare TypeError from a path join)."""
    path = save_checkpoint(tmp_path / "sh", random_state_dict(CFG, random_seed(gen)), CFG,
                           max_shard_bytes=400_000)
    f = path / "model.safetensors.index.json"
    index = json.loads(f.read_text())
    names = sorted(index["weight_map"])
    victim = names[int(torch.randint(0, len(names), (1,), generator=gen))]
    for bad in (None, 3, [index["weight_map"][victim]]):
        index["weight_map"][victim] = bad
        f.write_text(json.dumps(index))
        with pytest.raises(ValueError) as ei:
            load(path)
        assert str(f) in str(ei.value) and victim in str(ei.value), str(ei.value)


def test_missing_files_and_directories(tmp_path, gen):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        list(iter_checkpoint(tmp_path / "nowhere", CFG))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load(empty)
    (empty / "config.json").write_text(json.dumps(CFG.to_hf_dict()))
    with pytest.raises(FileNotFoundError, match="no safetensors weights"):
        load(empty)
    # a fallback *.safetensors name that is not model.safetensors still loads
    _, path = write_native(tmp_path, gen)
    (path / "model.safetensors").rename(path / "weights.safetensors")
    load(path)


def test_misc_inconsistencies_are_named(base, tmp_path):
    path, files = base
    E = CFG.n_routed_experts
    cases = [
        # an expert index beyond n_routed_experts
        ({f"layers.1.ffn.experts.{E}.w1.weight": files["layers.1.ffn.experts.0.w1.weight"].clone()},
         f"layers.1.ffn.experts.{E}.w1.weight"),
        # a layer beyond num_hidden_layers
        ({f"layers.{CFG.num_hidden_layers}.attn_norm.weight":
          files["layers.0.attn_norm.weight"].clone()},
         f"layers.{CFG.num_hidden_layers}.attn_norm.weight"),
        # the same parameter twice, in two layouts
        ({"model.embed_tokens.weight": files["embed.weight"].clone()}, "model.embed_tokens.weight"),
        # a gate bias on a hash layer (which has none)
        ({"layers.0.ffn.gate.bias": files["layers.1.ffn.gate.bias"].clone()},
         "layers.0.ffn.gate.bias"),
    ]
    for extra, named in cases:
        sub = tmp_path / f"c{len(named)}{abs(hash(named)) % 10**6}"
        sub.mkdir()
        _expect_error_naming(_write(sub, path, {**files, **extra}), named)
    # a whole expert gone from a layer
    gone = {k: v for k, v in files.items() if not k.startswith("layers.2.ffn.experts.5.")}
    sub = tmp_path / "gone"
    sub.mkdir()
    _expect_error_naming(_write(sub, path, gone), "layers.2.ffn.experts.5.w1.weight")
    # an FP8 weight whose scale grid is wrong
    bad = dict(files, **{"layers.1.attn.wq_b.scale": files["layers.1.attn.wq_b.scale"][:8]})
    sub = tmp_path / "grid"
    sub.mkdir()
    _expect_error_naming(_write(sub, path, bad), "layers.1.attn.wq_b.scale")
    # a tid2eid entry outside [0, E)
    t = files["layers.0.ffn.gate.tid2eid"].clone()
    t[5, 1] = E
    sub = tmp_path / "tid"
    sub.mkdir()
    _expect_error_naming(_write(sub, path, dict(files, **{"layers.0.ffn.gate.tid2eid": t})),
                         "layers.0.ffn.gate.tid2eid")


@pytest.mark.parametrize("change,named", [
    ({"layer_types": [SLIDING, "fancy_attention", HCA, CSA]}, "fancy_attention"),
    ({"mlp_layer_types": ["hash_moe", "moe", "dense", "moe"]}, "dense"),
    ({"layer_types": None, "compress_ratios": [0, 4, 64, 4]}, "64"),
])
def test_bad_config_is_named(base, tmp_path, change, named):
    path, _ = base
    out = tmp_path / "cfg"
    shutil.copytree(path, out)
    d = json.loads((out / "config.json").read_text())
    d.update(change)
    d = {k: v for k, v in d.items() if v is not None}
    (out / "config.json").write_text(json.dumps(d))
    _expect_error_naming(out, named)


def test_writer_refuses_to_overwrite_and_bad_arguments(tmp_path, gen):
    state, path = write_native(tmp_path, gen)
    with pytest.raises(FileExistsError):
        save_checkpoint(path, state, CFG)
    save_checkpoint(path, state, CFG, max_shard_bytes=500_000, overwrite=True)
    assert not (path / "model.safetensors").exists()
    with pytest.raises(ValueError, match="layout"):
        save_checkpoint(tmp_path / "x", state, CFG, layout="weird")
    with pytest.raises(ValueError, match="dense float32"):
        save_checkpoint(tmp_path / "y", state, CFG, layout="hf", fp8=True)


# ---------------------------------------------------------------- an EP rank's experts only

def _layouts(tmp_path, gen):
    """The same weights as: native (per-expert MXFP4), HF-internal (stacked dense floats),
    HF-internal quantized (stacked FP8 gate_up, stacked F4-typed MXFP4 down) and a dump of our
    own parameter names (stacked packed buffers)."""
    _, native = write_native(tmp_path, gen)
    want = params_of(native)
    hf = save_checkpoint(tmp_path / "hf", want, CFG, layout="hf")
    q = tmp_path / "hfq"
    q.mkdir()
    shutil.copy(hf / "config.json", q)
    files = read_all(hf)
    for L in range(CFG.num_hidden_layers):
        p = f"model.layers.{L}.mlp.experts."
        files[p + "gate_up_proj"], files[p + "gate_up_proj_scale_inv"] = stacked_fp8(
            files[p + "gate_up_proj"])
        files[p + "down_proj"] = want[p + "down_blocks"].clone().view(torch.float4_e2m1fn_x2)
        files[p + "down_proj_scale_inv"] = want[p + "down_scales"].view(torch.float8_e8m0fnu)
    save_file(files, str(q / "model.safetensors"))
    ours = tmp_path / "ours"
    ours.mkdir()
    shutil.copy(native / "config.json", ours)
    save_file(want, str(ours / "model.safetensors"))
    return {"native": native, "hf": hf, "hf-quantized": q, "ours": ours}


def test_expert_slots_read_only_those_experts(tmp_path, gen, monkeypatch):
    """iter_checkpoint(experts=[L, S]) gives each layer's expert buffers as the S slots' experts
    (replicas included, any order) - exactly the full load's rows - every other parameter as
    the full load, and reads no byte of an expert outside the slots: a per-expert tensor of
    another expert is never read, a stacked one only at the needed rows."""
    from zeroinfer.model import weights

    E, L = CFG.n_routed_experts, CFG.num_hidden_layers
    for layout, path in _layouts(tmp_path, gen).items():
        full = dict(iter_checkpoint(path))
        S = int(torch.randint(1, E + 4, (1,), generator=gen))
        slots = torch.randint(0, E, (L, S), generator=gen)
        slots[0, 0] = slots[0, -1]  # a replica at least once
        reads = []
        real = weights._Files.read

        def spy(self, key, rows=None, real=real):
            reads.append((key, rows))
            return real(self, key, rows)

        monkeypatch.setattr(weights._Files, "read", spy)
        got = dict(iter_checkpoint(path, experts=slots))
        monkeypatch.setattr(weights._Files, "read", real)
        assert set(got) == set(full), layout
        for name, t in full.items():
            m = weights.EXPERT_BUFFER.match(name)
            want = t[slots[int(m[1])]] if m else t
            assert got[name].shape == want.shape and torch.equal(got[name], want), (layout, name)
        for key, rows in reads:
            m = re.search(r"layers\.(\d+)\.(?:ffn|mlp)\.experts\.(\d+)\.", key)
            if m:  # a per-expert tensor: only experts of its layer's slots
                assert int(m[2]) in slots[int(m[1])].tolist(), (layout, key)
            elif (m := re.search(r"layers\.(\d+)\.mlp\.experts\.", key)):  # stacked
                assert rows == sorted(set(slots[int(m[1])].tolist())), (layout, key, rows)
            else:
                assert rows is None, (layout, key)
        stacked = [k for k, r in reads if r is not None]
        assert bool(stacked) == (layout != "native"), layout


def test_expert_slots_bad_argument_is_named(tmp_path, gen):
    _, path = write_native(tmp_path, gen)
    E, L = CFG.n_routed_experts, CFG.num_hidden_layers
    for bad in (torch.zeros(L + 1, 2, dtype=torch.long), torch.zeros(L, 2),
                torch.full((L, 2), E), torch.full((L, 2), -1), [[0, 1]] * L,
                torch.zeros(L, 0, dtype=torch.long)):
        with pytest.raises(ValueError, match="experts"):
            next(iter_checkpoint(path, experts=bad))
