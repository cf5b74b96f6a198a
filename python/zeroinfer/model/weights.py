"""Checkpoint reading and writing: DeepSeek-V4 safetensors in any of the three name layouts
(HF-internal, DeepSeek-native, HF's "reverse" hybrid) -> our parameter names.

Reading (`iter_checkpoint`) first checks the whole checkpoint from the safetensors headers
alone (names, dtypes, shapes, scale pairing, expert completeness, missing tensors), then reads
it tensor by tensor, so peak memory stays about one copy of the weights (plus, transiently, the
routed experts of one layer while they are stacked). An expert-parallel rank reads only the
routed experts of its own slots (`iter_checkpoint(..., experts=)`).

Formats understood per tensor (a tensor is quantized iff a sibling scale exists):
  * FP8 e4m3 (or its bytes as U8/I8) + 128x128 block scale (`X.scale` / `X.weight_scale_inv`,
    UE8M0 byte as F8_E8M0 or U8, or float32) -> dequantized to float32, W = q * scale per tile.
  * BF16 / F16 / F32 tensors without scale -> passed through as stored; integer tid2eid -> int64.
  * routed experts: native per-expert `...experts.E.w1/w2/w3.weight` as packed MXFP4 (I8, U8 or
    F4 = float4_e2m1fn_x2; two e2m1 per byte, low nibble = even element) + `.scale` [N, K/32]
    UE8M0 -> stacked into our packed gate_up_*/down_* buffers unchanged. Experts given as FP8 or
    dense floats (per expert, or HF's stacked gate_up_proj [E,2I,D] / down_proj [E,D,I]) are
    re-quantized to MXFP4, which must reproduce them exactly.
  * `mtp.{i}.*` (the multi-token-prediction modules) are read only when asked for (mtp=True):
    the block's tensors are named as a layer's (`mtp.0.attn.wq_a.weight` as `layers.N.attn...`),
    plus the module's own e_proj / h_proj (FP8), enorm / hnorm / norm and hc_head_*; otherwise
    they are ignored, as HF does.

Writing (`save_checkpoint`) produces the real V4-Flash layout (native names, FP8 linears with
UE8M0 scales, MXFP4 experts, BF16 embed/head/router/compressor, FP32 small tensors), or HF's
internal dense float32 layout.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator

import torch

from zeroinfer.model.config import ModelConfig
from zeroinfer.quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4, ue8m0_to_float32

FP8_BLOCK = 128
E4M3_MAX = 448.0
MX_BLOCK = 32
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic",
                           "weight_block_size": [FP8_BLOCK, FP8_BLOCK], "scale_fmt": "ue8m0",
                           "expert_dtype": "fp4"}

# --------------------------------------------------------------------------------------------
# names

# native -> HF-internal, applied in order to a name without its "model." prefix (this is the
# deepseek_v4 entry of transformers' conversion mapping, with leaf patterns anchored).
_TO_HF = [(re.compile(p), r) for p, r in [
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight$", "embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_(fn|base|scale)$", r".attn_hc.\1"),
    (r"\.hc_ffn_(fn|base|scale)$", r".ffn_hc.\1"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]]

# HF-internal -> native (the inverse, on a name without "model.")
_TO_NATIVE = [(re.compile(p), r) for p, r in [
    (r"^embed_tokens\.weight$", "embed.weight"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"),
    (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
    (r"\.sinks$", ".attn_sink"),
    (r"\.compressor\.indexer\.scorer\.weights_proj\.", ".indexer.weights_proj."),
    (r"\.compressor\.indexer\.q_b_proj\.", ".indexer.wq_b."),
    (r"\.compressor\.indexer\.", ".indexer.compressor."),
    (r"\.kv_norm\.", ".norm."),
    (r"\.position_bias$", ".ape"),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.gate_proj\.", ".wgate."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
]]

_MTP = re.compile(r"(^|\.)mtp\.")
# A checkpoint's MTP name: (module index, the rest); the rest is the module's own tensor or its
# block's, named as a layer's. Ours: mtp.{i}.<own> and mtp.{i}.block.<a layer's name>. While
# planning a read or a write, the block's tensors go by a "virtual" layer number past the main
# ones (num_hidden_layers + i), so the layers' rules (names, experts, FP8) apply unchanged.
_MTP_NAME = re.compile(r"^(?:model\.)?mtp\.(\d+)\.(.+)$")
_MTP_OWN = re.compile(r"^(?:(?:e_proj|h_proj)\.(?:weight|scale)|(?:enorm|hnorm|norm)\.weight"
                      r"|hc_head_(?:fn|base|scale))$")
_OUR_MTP_BLOCK = re.compile(r"^mtp\.(\d+)\.block\.(.+)$")
_VIRTUAL_LAYER = re.compile(r"^(model\.)?layers\.(\d+)\.(.+)$")
_NATIVE_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(w[123])\.weight$")
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj$")
# Our stacked routed-expert buffers (one per layer and kind), all E experts along dim 0.
EXPERT_BUFFER = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_(blocks|scales)$")
_FP8_MTP = re.compile(r"^mtp\.\d+\.(e_proj|h_proj)\.weight$")
_FP8_NATIVE = re.compile(r"^layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)"
                         r"|ffn\.shared_experts\.w[123])\.weight$")

LAYOUTS = ("native", "hybrid", "hf")


def virtual_name(name: str, layers: int) -> str:
    """Our MTP block tensor mtp.{i}.block.X -> model.layers.{layers + i}.X (others unchanged)."""
    m = _OUR_MTP_BLOCK.match(name)
    return f"model.layers.{layers + int(m[1])}.{m[2]}" if m else name


def real_name(name: str, layers: int) -> str:
    """virtual_name's inverse: model.layers.{n}.X with n >= layers -> mtp.{n - layers}.block.X."""
    m = _VIRTUAL_LAYER.match(name)
    if m and m[1] and int(m[2]) >= layers:
        return f"mtp.{int(m[2]) - layers}.block.{m[3]}"
    return name


def to_hf_name(name: str, layers: int | None = None) -> str | None:
    """Any checkpoint name (HF-internal, native or hybrid) -> HF-internal name. mtp.*: None,
    unless `layers` (the main layer count) is given: then the MTP module's own tensors get our
    names (mtp.{i}.e_proj.weight, mtp.{i}.hc_head.hc_fn, ...) and its block's the virtual layer
    layers + i's (see virtual_name)."""
    if _MTP.search(name):
        m = _MTP_NAME.match(name)
        if layers is None or m is None:
            return None
        i, rest = int(m[1]), m[2]
        if _MTP_OWN.match(rest):
            return f"mtp.{i}." + re.sub(r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1", rest)
        return to_hf_name(f"layers.{layers + i}.{rest}")
    n = name[len("model."):] if name.startswith("model.") else name
    for pat, rep in _TO_HF:
        n = pat.sub(rep, n)
    return n if n == "lm_head.weight" else "model." + n


def from_hf_name(name: str, layout: str) -> str:
    """HF-internal name -> the same tensor's name in `layout` ("native", "hybrid" or "hf").
    Not for our packed expert buffers (they have no single counterpart)."""
    if layout == "hf":
        return name
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    n = name[len("model."):] if name.startswith("model.") else name
    native = n
    for pat, rep in _TO_NATIVE:
        native = pat.sub(rep, native)
    if layout == "native":
        return native
    # hybrid (save_pretrained's default): the anchored top-level rules are not reversed
    # because the "model." prefix stays; lm_head -> head is.
    if name == "lm_head.weight":
        return "head.weight"
    return "model." + native if n.startswith("layers.") else name


def expert_name(layout: str, layer: int, expert: int, w: str) -> str:
    """Name of one expert matrix (w = "w1" | "w2" | "w3") in the native or hybrid layout."""
    n = f"layers.{layer}.ffn.experts.{expert}.{w}.weight"
    return "model." + n if layout == "hybrid" else n


def _scale_name(weight_key: str) -> str:
    """How a weight's sibling scale would be named (for error messages)."""
    if weight_key.endswith(".weight"):
        base = weight_key[: -len(".weight")]
        return f"{base}.scale' or '{base}.weight_scale_inv"
    return weight_key + "_scale_inv"


# --------------------------------------------------------------------------------------------
# number formats

def _scale_to_float(scale: torch.Tensor, name: str) -> torch.Tensor:
    if scale.dtype == torch.float32:
        if not bool(torch.isfinite(scale).all()):
            raise ValueError(f"scale tensor {name!r} holds non-finite values")
        return scale
    if bool((scale.view(torch.uint8) == 255).any()):
        raise ValueError(f"scale tensor {name!r} holds the UE8M0 NaN byte 0xFF")
    return ue8m0_to_float32(scale)


def _scale_to_ue8m0(scale: torch.Tensor, name: str) -> torch.Tensor:
    """An MXFP4 scale (F8_E8M0 / U8 bytes, or float32 powers of two) -> uint8 bytes."""
    if scale.dtype == torch.float32:
        m, e = torch.frexp(scale)
        b = e.to(torch.int32) + 126
        if not bool(((m == 0.5) & (b >= 0) & (b <= 254)).all()):
            raise ValueError(f"MXFP4 scale {name!r} is float32 but not all values are powers of "
                             "two in [2^-127, 2^127] (UE8M0-valued)")
        return b.to(torch.uint8)
    out = scale.view(torch.uint8)
    if bool((out == 255).any()):
        raise ValueError(f"MXFP4 scale {name!r} holds the UE8M0 NaN byte 0xFF")
    return out


def fp8_scale_shape(shape) -> tuple[int, ...]:
    *lead, n, k = shape
    return (*lead, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK))


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """Blockwise FP8 -> float32: W = q * scale, one scale per 128x128 tile (leading dims kept).
    q: float8_e4m3fn or its bytes (uint8/int8); scale: UE8M0 bytes or float32."""
    if q.dtype in (torch.uint8, torch.int8):
        q = q.view(torch.float8_e4m3fn)
    *_, n, k = q.shape
    s = _scale_to_float(scale, name + " scale")
    s = s.repeat_interleave(FP8_BLOCK, dim=-2)[..., :n, :]
    s = s.repeat_interleave(FP8_BLOCK, dim=-1)[..., :k]
    w = q.to(torch.float32) * s
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"FP8 tensor {name!r} holds NaN/inf codes (or its scale overflows)")
    return w


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (float8_e4m3fn [N, K], float8_e8m0fnu [ceil(N/128), ceil(K/128)]):
    per tile scale = 2^ceil(log2(amax / 448)) (1 for an all-zero tile), q = w / scale."""
    w = w.detach().to(torch.float32)
    n, k = w.shape
    tn, tk = fp8_scale_shape(w.shape)
    pad = torch.zeros(tn * FP8_BLOCK, tk * FP8_BLOCK, dtype=torch.float32)
    pad[:n, :k] = w
    amax = pad.view(tn, FP8_BLOCK, tk, FP8_BLOCK).abs().amax(dim=(1, 3)).double()
    mant, ex = torch.frexp(amax / E4M3_MAX)  # x = mant * 2^ex, mant in [0.5, 1)
    e = torch.where(mant > 0.5, ex, ex - 1).to(torch.int32)  # ceil(log2 x)
    e = torch.where(amax > 0, e, torch.zeros_like(e)).clamp(-127, 127)
    byte = (e + 127).to(torch.uint8)
    s = ue8m0_to_float32(byte)
    s_full = s.repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
    q = (w / s_full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, byte.view(torch.float8_e8m0fnu)


def _requantize_exact(w: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.to(torch.float32)
    packed, scale = quantize_mxfp4(w)
    back = dequantize_mxfp4(packed, scale)
    if back.shape != w.shape or not bool((back == w).all()):
        bad = int((back != w).sum()) if back.shape == w.shape else w.numel()
        raise ValueError(
            f"routed expert tensor {name!r} is not exactly representable as MXFP4 ({bad} of "
            f"{w.numel()} values change when quantized to e2m1 with a UE8M0 scale per "
            f"{MX_BLOCK}); dense (non-MXFP4) routed experts are not supported")
    return packed.to(torch.uint8), scale.view(torch.uint8)


# --------------------------------------------------------------------------------------------
# checkpoint files

# safetensors dtype strings
_FLOATS = {"F32", "BF16", "F16", "F64"}
_INTS = {"I64", "I32"}
_BYTES = {"U8", "I8"}
_FP8_W = {"F8_E4M3", "U8", "I8"}
_SCALES = {"F8_E8M0", "U8", "F32"}
_FP4_W = {"F4", "U8", "I8"}


@dataclass
class _Entry:
    key: str
    file: Path
    dtype: str
    shape: tuple[int, ...]  # torch shape (F4: bytes, i.e. half the stored element count)

    def where(self) -> str:
        return f"{self.file}: tensor {self.key!r}"


class _Files:
    """The safetensors files of a checkpoint and the header of every tensor."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self._safe_open = safe_open
        self.path = path
        self.entries: dict[str, _Entry] = {}
        self._handles: dict[Path, object] = {}
        files, listed = self._locate(path)
        for f in files:
            h = self._open(f)
            for k in h.keys():
                sl = h.get_slice(k)
                dtype, shape = sl.get_dtype(), tuple(int(s) for s in sl.get_shape())
                if dtype == "F4" and shape:
                    shape = (*shape[:-1], shape[-1] // 2)
                if k in self.entries:
                    raise ValueError(f"tensor {k!r} is stored twice: in {self.entries[k].file} "
                                     f"and in {f}")
                self.entries[k] = _Entry(k, f, dtype, shape)
        for k, f in listed.items():
            e = self.entries.get(k)
            if e is None or e.file != f:
                raise ValueError(f"{path / INDEX_FILE}: tensor {k!r} is listed in shard {f.name} "
                                 f"but that file does not hold it")

    @staticmethod
    def _locate(path: Path) -> tuple[list[Path], dict[str, Path]]:
        if path.is_file() and path.suffix == ".safetensors":
            return [path], {}
        if not path.exists():
            raise FileNotFoundError(f"checkpoint directory {path} does not exist")
        if not path.is_dir():
            raise FileNotFoundError(f"checkpoint path {path} is not a directory")
        index = path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                assert isinstance(weight_map, dict)
            except (json.JSONDecodeError, KeyError, TypeError, AssertionError) as e:
                raise ValueError(f"{index}: not a valid safetensors index (needs a 'weight_map' "
                                 f"object): {e!r}") from e
            for k, name in weight_map.items():  # (before any path is joined with them)
                if not isinstance(name, str) or not name:
                    raise ValueError(f"{index}: tensor {k!r} is mapped to {name!r}, not to a "
                                     "shard's file name")
            files: list[Path] = []
            for name in weight_map.values():
                f = path / name
                if f not in files:
                    files.append(f)
            for f in files:
                if not f.is_file():
                    raise FileNotFoundError(f"shard {f} listed in {index} does not exist")
            return files, {k: path / v for k, v in weight_map.items()}
        if (path / SINGLE_FILE).is_file():
            return [path / SINGLE_FILE], {}
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no safetensors weights in {path} (expected {SINGLE_FILE}, "
                                    f"{INDEX_FILE} or *.safetensors)")
        return files, {}

    def _open(self, f: Path):
        h = self._handles.get(f)
        if h is None:
            try:
                h = self._safe_open(str(f), framework="pt")
            except Exception as e:  # SafetensorError, OSError
                raise ValueError(f"{f}: cannot read safetensors file (truncated or corrupt?): "
                                 f"{e}") from e
            self._handles[f] = h
        return h

    def read(self, key: str, rows: list[int] | None = None) -> torch.Tensor:
        """The tensor, or only its leading-dimension entries `rows` (sorted, distinct), read
        run by run of consecutive rows so that the others never leave the file."""
        e = self.entries[key]
        try:
            h = self._open(e.file)
            if rows is None:
                return h.get_tensor(key)
            if e.dtype == "F4":  # safetensors 0.8 cannot slice F4: read it whole
                t = h.get_tensor(key)
                return t.view(torch.uint8)[rows].view(t.dtype)
            sl = h.get_slice(key)
            runs, start = [], 0
            for i in range(1, len(rows) + 1):
                if i == len(rows) or rows[i] != rows[i - 1] + 1:
                    runs.append(sl[rows[start]:rows[i - 1] + 1])
                    start = i
            return runs[0] if len(runs) == 1 else torch.cat(runs)
        except Exception as err:
            raise ValueError(f"{e.where()}: cannot read ({err})") from err

    def layout(self) -> str:
        keys = self.entries
        if any(k.startswith("layers.") or k in ("embed.weight", "head.weight") for k in keys):
            return "native"
        if any(k.startswith("model.layers.") and (".attn." in k or ".ffn." in k) for k in keys):
            return "hybrid"
        return "hf"


# --------------------------------------------------------------------------------------------
# the plan: which checkpoint tensors make which of our parameters


@dataclass
class _Recipe:
    kind: str  # "plain" | "fp8" | "experts_native" | "experts_hf"
    targets: list[str]
    keys: list[str]  # checkpoint tensors read (for ordering)
    key: str | None = None
    scale: str | None = None
    layer: int = -1
    proj: str = ""  # experts_hf: "gate_up" | "down"
    fmt: str = ""  # experts_hf: see _expert_format
    experts: dict = field(default_factory=dict)  # experts_native: (e, w) -> (key, scale, fmt)


def _expected(config: ModelConfig, mtp: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter the model has, by name (the MTP blocks' by their virtual layer names)."""
    from zeroinfer.model.deepseek_v4 import DeepseekV4ForCausalLM

    with torch.device("meta"):
        net = DeepseekV4ForCausalLM(config, mtp=mtp)
    return {virtual_name(k, config.num_hidden_layers): v for k, v in net.state_dict().items()}


def _expert_format(files: _Files, key: str, scale: str | None, shape: tuple[int, ...]) -> str:
    """Classify one routed-expert tensor of logical shape [..., N, K]: "mxfp4" (packed bytes +
    [..., N, K/32] scale), "fp8" ([..., N, K] e4m3 + tile scale) or "dense" (floats, no scale).
    Raises naming the tensor for anything else."""
    e = files.entries[key]
    *lead, n, k = shape
    packed, full = (*lead, n, k // 2), tuple(shape)
    if e.dtype == "F4" or (e.dtype in _BYTES and e.shape == packed):
        if e.shape != packed:
            raise ValueError(f"{e.where()} has shape {e.shape}, expected {packed} (packed MXFP4)")
        if scale is None:
            raise ValueError(f"{e.where()}: packed MXFP4 expert weight without its scale "
                             f"(expected a sibling '{_scale_name(key)}')")
        s = files.entries[scale]
        want = (*lead, n, k // MX_BLOCK)
        if s.dtype not in _SCALES:
            raise TypeError(f"{s.where()}: MXFP4 scale has dtype {s.dtype}, expected F8_E8M0 or "
                            "U8 (UE8M0 bytes) or F32")
        if s.shape != want:
            raise ValueError(f"{s.where()} has shape {s.shape}, expected {want} (one UE8M0 scale "
                             f"per {MX_BLOCK} elements of {key!r})")
        return "mxfp4"
    if e.dtype in _FP8_W:
        if e.shape != full:
            raise ValueError(f"{e.where()} has shape {e.shape}, expected {packed} (packed MXFP4) "
                             f"or {full} (FP8)")
        if scale is None:
            raise ValueError(f"{e.where()}: FP8 weight without its scale (expected a sibling "
                             f"'{_scale_name(key)}')")
        _check_fp8_scale(files, key, scale)
        return "fp8"
    if e.dtype in _FLOATS:
        if scale is not None:
            raise TypeError(f"{e.where()} has dtype {e.dtype} but a scale {scale!r}: a scaled "
                            "expert weight must be packed MXFP4 bytes (I8/U8/F4) or F8_E4M3")
        if e.shape != full:
            raise ValueError(f"{e.where()} has shape {e.shape}, expected {full}")
        return "dense"
    raise TypeError(f"{e.where()} has dtype {e.dtype}: routed expert weights must be packed "
                    "MXFP4 bytes (I8/U8/F4), F8_E4M3 with a scale, or floats")


def _check_fp8_scale(files: _Files, key: str, scale: str) -> None:
    e, s = files.entries[key], files.entries[scale]
    if s.dtype not in _SCALES:
        raise TypeError(f"{s.where()}: FP8 scale has dtype {s.dtype}, expected F8_E8M0 or U8 "
                        "(UE8M0 bytes) or F32")
    want = fp8_scale_shape(e.shape)
    if s.shape != want:
        raise ValueError(f"{s.where()} has shape {s.shape}, expected {want} (one scale per "
                         f"{FP8_BLOCK}x{FP8_BLOCK} tile of {key!r} {e.shape})")


def _plan(files: _Files, config: ModelConfig, params: dict[str, torch.Tensor],
          mtp: bool = False) -> list[_Recipe]:
    keys = files.entries
    layout = files.layout()
    c = config
    E, D, I = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size
    L = c.num_hidden_layers
    blocks = L + (c.num_nextn_predict_layers if mtp else 0)  # main layers, then MTP blocks

    def skip(k: str) -> bool:  # (mtp.* unless asked for, and then only the config's modules)
        m = _MTP_NAME.match(k)
        return bool(_MTP.search(k)) and not (mtp and m and int(m[1]) < blocks - L)

    def hf_name(k: str) -> str | None:
        return to_hf_name(k, L if mtp else None)

    # 1. pair weights with their scales
    scale_of: dict[str, str] = {}
    orphans: set[str] = set()
    problems: list[str] = []
    for k in keys:
        if skip(k):
            continue
        w = None
        if k.endswith(".weight_scale_inv"):
            w = k[: -len("_scale_inv")]
        elif k.endswith(".scale"):
            w = k[: -len(".scale")] + ".weight"
            if w not in keys and hf_name(k) in params:
                w = None  # an mHC .scale parameter of the HF-internal layout, not a scale
        elif k.endswith("_scale_inv") and k[: -len("_scale_inv")] in keys:
            w = k[: -len("_scale_inv")]
        if w is None:
            continue
        if w not in keys:
            orphans.add(k)
            problems.append(f"{keys[k].where()} is a scale but its weight {w!r} is missing")
        elif w in scale_of:
            problems.append(f"{keys[k].where()}: weight {w!r} has two scales, {scale_of[w]!r} "
                            f"and {k!r}")
        else:
            scale_of[w] = k
    scales = set(scale_of.values()) | orphans

    # 2. map every other tensor to our parameters
    recipes: list[_Recipe] = []
    native_experts: dict[int, dict[tuple[int, str], str]] = {}
    unknown: list[str] = []
    for k, ent in keys.items():
        if k in scales or skip(k):
            continue
        hf = hf_name(k)
        m = _NATIVE_EXPERT.match(hf)
        if m and int(m[1]) < blocks and int(m[2]) < E:
            native_experts.setdefault(int(m[1]), {})[(int(m[2]), m[3])] = k
            continue
        m = _HF_EXPERT.match(hf)
        if m and int(m[1]) < blocks:
            base = f"model.layers.{m[1]}.mlp.experts.{m[2]}"
            recipes.append(_Recipe("experts_hf", [base + "_blocks", base + "_scales"], [k], key=k,
                                   scale=scale_of.get(k), layer=int(m[1]), proj=m[2]))
            continue
        if hf not in params:
            unknown.append(f"{k!r} (in {ent.file.name})")
            continue
        if k in scale_of:
            recipes.append(_Recipe("fp8", [hf], [k, scale_of[k]], key=k, scale=scale_of[k]))
        else:
            recipes.append(_Recipe("plain", [hf], [k], key=k))
    if unknown:
        problems.insert(0, f"{files.path}: unknown tensor(s) {', '.join(unknown)}: not a "
                        f"parameter of this model ({c.num_hidden_layers} layers, "
                        f"{E} routed experts)")
    if problems:
        raise ValueError("; ".join(problems))
    # A tied head (HF's save_pretrained leaves it out): the embedding's tensor read again. A
    # head the checkpoint does hold is its own (HF unties what is given twice).
    if c.tie_word_embeddings and not any("lm_head.weight" in r.targets for r in recipes):
        recipes += [replace(r, targets=["lm_head.weight"]) for r in recipes
                    if r.targets == ["model.embed_tokens.weight"]]

    for layer in sorted(native_experts):
        got = native_experts[layer]
        template = next(iter(got.values()))
        missing = [(e, w) for e in range(E) for w in ("w1", "w2", "w3") if (e, w) not in got]
        if missing:
            names = [re.sub(r"experts\.\d+\.w[123]\.", f"experts.{e}.{w}.", template)
                     for e, w in missing]
            more = f" and {len(names) - 8} more" if len(names) > 8 else ""
            raise ValueError(f"{files.path}: layer {layer} routed experts incomplete: missing "
                             f"{names[:8]}{more}")
        r = _Recipe("experts_native", [f"model.layers.{layer}.mlp.experts.{p}_{q}"
                                       for p in ("gate_up", "down") for q in ("blocks", "scales")],
                    [], layer=layer)
        for (e, w), k in sorted(got.items()):
            n, kk = (D, I) if w == "w2" else (I, D)
            fmt = _expert_format(files, k, scale_of.get(k), (n, kk))
            r.experts[(e, w)] = (k, scale_of.get(k), fmt)
            r.keys += [k] + ([scale_of[k]] if k in scale_of else [])
        recipes.append(r)

    # 3. every parameter exactly once; headers (dtype, shape) agree with the model
    owner: dict[str, str] = {}
    for r in recipes:
        src = r.key or f"layer {r.layer} per-expert w1/w2/w3 tensors"
        for t in r.targets:
            if t in owner:
                raise ValueError(f"{files.path}: {t!r} is given twice, by {owner[t]!r} and {src!r}")
            owner[t] = src
    missing = [t for t in params if t not in owner]
    if missing:
        names = [_display(t, layout, L) for t in missing]
        raise ValueError(f"{files.path}: missing tensor(s) {names[:8]}"
                         + (f" and {len(names) - 8} more" if len(names) > 8 else ""))
    for r in recipes:
        if r.kind in ("plain", "fp8"):
            _check_header(files, r, params[r.targets[0]])
        elif r.kind == "experts_hf":
            n, kk = (2 * I, D) if r.proj == "gate_up" else (D, I)
            r.fmt = _expert_format(files, r.key, r.scale, (E, n, kk))
    return recipes


def mtp_native_name(name: str, layers: int) -> str:
    """A native-layout name (of a layer's, or an MTP module's own tensor under our name) with
    the virtual layers past `layers` renamed as the MTP modules they are: layers.{layers + i}.X
    -> mtp.{i}.X, mtp.{i}.hc_head.hc_fn -> mtp.{i}.hc_head_fn."""
    name = re.sub(r"^(mtp\.\d+\.)hc_head\.hc_(fn|base|scale)$", r"\1hc_head_\2", name)
    m = _VIRTUAL_LAYER.match(name)
    if m and not m[1] and int(m[2]) >= layers:
        return f"mtp.{int(m[2]) - layers}.{m[3]}"
    return name


def _display(target: str, layout: str, layers: int) -> str:
    """How a parameter of ours would be named in a checkpoint of `layout`."""
    real = real_name(target, layers)
    if real.startswith("mtp."):  # (the MTP modules are only in the native layout)
        m = EXPERT_BUFFER.match(target)
        native = (expert_name("native", int(m[1]), 0, "w1").replace("experts.0.w1.", "experts.*.")
                  if m else target if target.startswith("mtp.") else from_hf_name(target, "native"))
        return f"{mtp_native_name(native, layers)} (our {real})"
    m = EXPERT_BUFFER.match(target)
    if m:
        if layout == "hf":
            return f"model.layers.{m[1]}.mlp.experts.{m[2]}_proj"
        ws = "w1/w3" if m[2] == "gate_up" else "w2"
        return (expert_name(layout, int(m[1]), 0, "w1").replace("experts.0.w1.", f"experts.*.{ws}.")
                + f" (our {target})")
    name = from_hf_name(target, layout)
    return name if name == target else f"{name} (our {target})"


def _check_header(files: _Files, r: _Recipe, want: torch.Tensor) -> None:
    e = files.entries[r.key]
    wshape = tuple(want.shape)
    if r.kind == "fp8":
        if not want.is_floating_point():
            raise TypeError(f"{e.where()} has a scale {r.scale!r} but {r.targets[0]!r} is not a "
                            "floating-point parameter")
        if e.dtype not in _FP8_W:
            raise TypeError(f"{e.where()} has dtype {e.dtype} but a scale {r.scale!r}: a scaled "
                            "weight must be F8_E4M3 (or its bytes, U8/I8)")
        if e.shape != wshape:
            raise ValueError(f"{e.where()} has shape {e.shape}, expected {wshape}")
        _check_fp8_scale(files, r.key, r.scale)
        return
    if e.shape != wshape:
        raise ValueError(f"{e.where()} has shape {e.shape}, expected {wshape}")
    if want.dtype == torch.uint8:
        ok = _BYTES | ({"F8_E8M0"} if r.targets[0].endswith("_scales") else {"F4"})
        what = "1-byte (U8/I8" + (", F8_E8M0)" if r.targets[0].endswith("_scales") else ", F4)")
    elif want.is_floating_point():
        ok, what = _FLOATS, "floating point (F32/BF16/F16)"
    else:
        ok, what = _INTS, "integer (I64/I32)"
    if e.dtype not in ok:
        if want.is_floating_point() and e.dtype == "F8_E4M3":
            raise ValueError(f"{e.where()}: FP8 weight without its scale (expected a sibling "
                             f"'{_scale_name(r.key)}')")
        raise TypeError(f"{e.where()} has dtype {e.dtype}, expected {what}")


# --------------------------------------------------------------------------------------------
# reading


def _run(files: _Files, r: _Recipe, config: ModelConfig,
         slots: list[int] | None) -> Iterator[tuple[str, torch.Tensor]]:
    """The parameters of one recipe. slots: for routed experts, the logical expert of each slot
    to keep (None: every expert, in order)."""
    need = None if slots is None else sorted(set(slots))
    if r.kind == "plain":  # (our own stacked expert buffers come this way too)
        t = _in_slot_order(files.read(r.key, need), need, slots)
        name = r.targets[0]
        if not t.is_floating_point() and t.dtype in (torch.int32, torch.int64):
            t = t.to(torch.int64)
            if name.endswith("tid2eid"):
                E = config.n_routed_experts
                if bool(((t < 0) | (t >= E)).any()):
                    raise ValueError(f"{files.entries[r.key].where()}: expert ids outside [0, {E})")
        elif name.endswith(("_blocks", "_scales")):
            t = t.view(torch.uint8)
            if name.endswith("_scales") and bool((t == 255).any()):
                raise ValueError(f"{files.entries[r.key].where()}: UE8M0 NaN byte 0xFF")
        yield name, t
    elif r.kind == "fp8":
        yield r.targets[0], dequantize_fp8(files.read(r.key), files.read(r.scale), r.key)
    elif r.kind == "experts_hf":
        blocks, scales = _read_expert(files, r.key, r.scale, r.fmt, need)
        yield r.targets[0], _in_slot_order(blocks, need, slots)
        yield r.targets[1], _in_slot_order(scales, need, slots)
    else:  # experts_native: stack this layer's experts (only those of `slots`, if given)
        order = list(range(config.n_routed_experts)) if slots is None else slots
        keep = set(order)
        got = {ew: _read_expert(files, *spec) for ew, spec in r.experts.items() if ew[0] in keep}
        gate_up = [torch.cat([got[(e, "w1")][0], got[(e, "w3")][0]]) for e in order]
        yield r.targets[0], torch.stack(gate_up)
        del gate_up
        yield r.targets[1], torch.stack([torch.cat([got[(e, "w1")][1], got[(e, "w3")][1]])
                                         for e in order])
        yield r.targets[2], torch.stack([got[(e, "w2")][0] for e in order])
        yield r.targets[3], torch.stack([got[(e, "w2")][1] for e in order])


def _in_slot_order(t: torch.Tensor, need: list[int] | None, slots: list[int] | None):
    """t holds the experts `need` (sorted, distinct) along dim 0: one per slot, in slot order."""
    if slots is None:
        return t
    return t[torch.tensor([need.index(e) for e in slots])]


def _read_expert(files: _Files, key: str, scale: str | None, fmt: str,
                 rows: list[int] | None = None):
    """One routed-expert tensor (one expert's, or HF's stacked [E, ...] - of which only the
    experts `rows`, when given) as packed MXFP4 bytes and UE8M0 scales."""
    t = files.read(key, rows)
    if fmt == "mxfp4":
        return t.view(torch.uint8), _scale_to_ue8m0(files.read(scale, rows), scale)
    w = dequantize_fp8(t, files.read(scale, rows), key) if fmt == "fp8" else t
    return _requantize_exact(w, key)


def iter_checkpoint(path, config: ModelConfig | None = None, *, mtp: bool = False,
                    experts: torch.Tensor | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (our parameter name, tensor) for every parameter of the model, reading the
    checkpoint directory `path` tensor by tensor. The whole checkpoint is validated from the
    safetensors headers before the first tensor is read. Raises FileNotFoundError / ValueError /
    TypeError naming the offending file or tensor.

    mtp: read the config's MTP modules too (they must all be there; all E experts of theirs,
    whatever `experts` says); skipped otherwise.
    experts: [num_hidden_layers, S] integer tensor, the logical routed expert of each of S slots
    a layer (an expert-parallel rank's: ExpertParallel.local_experts()). The expert buffers then
    hold those S experts in that order, and no other expert's bytes are read from the files."""
    path = Path(path)
    if config is None:
        config = ModelConfig.from_pretrained(path)
    files = _Files(path)
    params = _expected(config, mtp)
    slots = _expert_slots(experts, config)
    recipes = _plan(files, config, params, mtp)  # (checks the files' shapes: all E experts)
    L = config.num_hidden_layers
    if slots is not None:  # what comes out: S slots (of the main layers; an MTP block all E)
        for name, t in params.items():
            if (m := EXPERT_BUFFER.match(name)) and int(m[1]) < L:
                params[name] = t.new_empty((len(slots[0]), *t.shape[1:]))
    order = {k: i for i, k in enumerate(files.entries)}
    recipes.sort(key=lambda r: min(order[k] for k in r.keys))
    done: set[str] = set()
    for r in recipes:
        layer = r.layer
        if layer < 0 and (m := EXPERT_BUFFER.match(r.targets[0])):  # our own names, stored
            layer = int(m[1])
        for name, t in _run(files, r, config, None if slots is None or not 0 <= layer < L
                            else slots[layer]):
            want = params[name]
            if tuple(t.shape) != tuple(want.shape):  # cannot happen after _plan; belt and braces
                raise ValueError(f"{path}: {name!r} came out with shape {tuple(t.shape)}, "
                                 f"expected {tuple(want.shape)}")
            done.add(name)
            yield real_name(name, L), t
    missing = [n for n in params if n not in done]
    if missing:
        raise ValueError(f"{path}: missing tensor(s) {missing[:8]}")


def _expert_slots(experts, config: ModelConfig) -> list[list[int]] | None:
    if experts is None:
        return None
    L, E = config.num_hidden_layers, config.n_routed_experts
    ok = isinstance(experts, torch.Tensor)
    if (not ok or experts.dim() != 2 or experts.shape[0] != L or experts.shape[1] < 1
            or experts.is_floating_point() or experts.is_complex()):
        got = f"{tuple(experts.shape)} {experts.dtype}" if ok else repr(experts)
        raise ValueError(f"iter_checkpoint: experts must be an integer tensor [{L} layers, "
                         f"slots >= 1], got {got}")
    if bool(((experts < 0) | (experts >= E)).any()):
        raise ValueError(f"iter_checkpoint: experts holds ids outside [0, {E})")
    return experts.tolist()


def dequantized_state(path, config: ModelConfig | None = None) -> dict[str, torch.Tensor]:
    """The parameters a checkpoint loads as (FP8 dequantized, experts packed), as one dict."""
    return dict(iter_checkpoint(path, config))


# --------------------------------------------------------------------------------------------
# writing


def _state_of(model_or_state) -> dict[str, torch.Tensor]:
    if isinstance(model_or_state, dict):
        return model_or_state
    net = getattr(model_or_state, "net", model_or_state)
    if not hasattr(net, "state_dict"):
        raise TypeError("save_checkpoint: model_or_state must be a zeroinfer Model, a "
                        "DeepseekV4ForCausalLM or a state dict, got "
                        f"{type(model_or_state).__name__}")
    return net.state_dict()


def _dequantize_packed(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return dequantize_mxfp4(blocks, scales)


def _native_tensors(state, config: ModelConfig, layout: str, fp8: bool):
    """(name, tensor) pairs of the native (or hybrid) layout, one at a time."""
    I, L = config.moe_intermediate_size, config.num_hidden_layers
    for name, t in state.items():
        t = t.detach().cpu()
        # The MTP modules' tensors: native names in either layout (HF has none of its own);
        # their block's through the layers' rules, by its virtual layer number.
        is_mtp = name.startswith("mtp.")
        lay = "native" if is_mtp else layout
        name = virtual_name(name, L)

        def rename(n: str) -> str:
            return mtp_native_name(n, L) if is_mtp else n

        m = EXPERT_BUFFER.match(name)
        if m:
            if m[3] == "scales":
                continue
            layer, proj = int(m[1]), m[2]
            blocks = t.view(torch.uint8)
            scales = state[real_name(name[: -len("blocks")] + "scales", L)].detach().cpu().view(
                torch.uint8)
            parts = ([("w1", slice(0, I)), ("w3", slice(I, 2 * I))] if proj == "gate_up"
                     else [("w2", slice(None))])
            for e in range(blocks.shape[0]):
                for w, rows in parts:
                    n = rename(expert_name(lay, layer, e, w))
                    b, s = blocks[e, rows].contiguous(), scales[e, rows].contiguous()
                    if fp8:
                        yield n, b.view(torch.int8)
                        yield n[: -len(".weight")] + ".scale", s.view(torch.float8_e8m0fnu)
                    else:
                        yield n, _dequantize_packed(b, s)
            continue
        native = rename(from_hf_name(name, "native"))
        out = rename(from_hf_name(name, lay))
        if not t.is_floating_point():
            yield out, t.to(torch.int64)
        elif not fp8:
            yield out, t.to(torch.float32)
        elif _FP8_NATIVE.match(from_hf_name(name, "native")) or _FP8_MTP.match(native):
            q, s = quantize_fp8(t)
            yield out, q
            yield out[: -len(".weight")] + ".scale", s
        elif native.endswith(".weight") and t.dim() == 2:
            yield out, t.to(torch.bfloat16)  # embed, head, router gate, compressor/indexer
        else:
            yield out, t.to(torch.float32)  # norms, hc_*, attn_sink, ape, gate bias


def _hf_tensors(state):
    for name, t in state.items():
        if name.startswith("mtp."):  # (HF's layout has no MTP modules)
            continue
        t = t.detach().cpu()
        m = EXPERT_BUFFER.match(name)
        if m:
            if m[3] == "blocks":
                base = name[: -len("_blocks")]
                yield base + "_proj", _dequantize_packed(t, state[base + "_scales"].detach().cpu())
            continue
        yield name, t.to(torch.float32) if t.is_floating_point() else t.to(torch.int64)


def save_checkpoint(path, model_or_state, config: ModelConfig, *, layout: str = "native",
                    fp8: bool | None = None, max_shard_bytes: int | None = None,
                    overwrite: bool = False) -> Path:
    """Write config.json and safetensors weights to the directory `path`.

    layout="native" (default): DeepSeek's names; with fp8 (default True) the real V4-Flash
    formats: FP8 e4m3 attention/indexer/shared-expert linears with 128x128 UE8M0 `.scale`s,
    MXFP4 experts (I8 bytes + F8_E8M0 `.scale`), BF16 embed/head/router/compressor/indexer
    projections, FP32 small tensors, int64 tid2eid; with fp8=False every float tensor is float32
    and experts are dequantized per expert. layout="hybrid": the same with save_pretrained's
    default hybrid names. layout="hf": HF-internal names, dense float32 (experts dequantized to
    gate_up_proj/down_proj); fp8 must be False/None there.
    With max_shard_bytes, shards `model-0000i-of-0000n.safetensors` plus an index are written.
    """
    from safetensors.torch import save_file

    if layout not in LAYOUTS:
        raise ValueError(f"save_checkpoint: layout must be one of {LAYOUTS}, got {layout!r}")
    if fp8 is None:
        fp8 = layout != "hf"
    if layout == "hf" and fp8:
        raise ValueError("save_checkpoint: layout='hf' writes dense float32 weights; use "
                         "layout='native' (or 'hybrid') for FP8")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    old = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.safetensors.index.json"))
    if old:
        if not overwrite:
            raise FileExistsError(f"save_checkpoint: {path} already holds weights ({old[0].name}); "
                                  "pass overwrite=True to replace them")
        for f in old:
            f.unlink()
    state = _state_of(model_or_state)
    cfg = config.to_hf_dict()
    if fp8:
        cfg["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    tensors = _hf_tensors(state) if layout == "hf" else _native_tensors(state, config, layout, fp8)
    meta = {"format": "pt"}
    if max_shard_bytes is None:
        out: dict[str, torch.Tensor] = {}
        for name, t in tensors:
            if name in out:
                raise ValueError(f"save_checkpoint: tensor name {name!r} produced twice")
            out[name] = t.contiguous()
        save_file(out, str(path / SINGLE_FILE), metadata=meta)
        return path
    if max_shard_bytes < 1:
        raise ValueError("save_checkpoint: max_shard_bytes must be positive, got "
                         f"{max_shard_bytes}")
    # stream: write each shard once full under a temporary name, rename once the count is known
    written: list[tuple[Path, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    size = total = 0
    seen: set[str] = set()

    def flush():
        tmp = path / f".shard-{len(written):05d}.safetensors.tmp"
        save_file(shard, str(tmp), metadata=meta)
        written.append((tmp, list(shard)))

    for name, t in tensors:
        if name in seen:
            raise ValueError(f"save_checkpoint: tensor name {name!r} produced twice")
        seen.add(name)
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > max_shard_bytes:
            flush()
            shard, size = {}, 0
        shard[name] = t.contiguous()
        size += nbytes
        total += nbytes
    if shard or not written:
        flush()
    weight_map = {}
    for i, (tmp, names) in enumerate(written):
        fname = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
        tmp.rename(path / fname)
        weight_map.update({k: fname for k in names})
    (path / INDEX_FILE).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return path


__all__ = ["FP8_QUANTIZATION_CONFIG", "dequantize_fp8", "dequantized_state", "from_hf_name",
           "iter_checkpoint", "quantize_fp8", "save_checkpoint", "to_hf_name"]
