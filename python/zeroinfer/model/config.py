"""ModelConfig: the DeepSeek-V4 hyper-parameters the graph needs, read from a checkpoint's
config.json (HF names, with the legacy DeepSeek keys folded in the way HF folds them)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
ATTENTION_TYPES = (SLIDING, CSA, HCA)
HASH_MOE, MOE = "hash_moe", "moe"
MLP_TYPES = (HASH_MOE, MOE)
_RATIO_TO_TYPE = {0: SLIDING, 1: SLIDING, 4: CSA, 128: HCA}


def _yarn_mscale(factor: float, params: dict) -> float:
    """YaRN's default attention factor, as HF derives it."""

    def get(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    ms, ms_all = params.get("mscale"), params.get("mscale_all_dim")
    return get(factor, ms) / get(factor, ms_all) if ms and ms_all else get(factor)


@dataclass(frozen=True)
class YarnScaling:
    """YaRN parameters of the compress RoPE table (HF: rope_parameters["compress"])."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # Multiplies cos/sin. The V4 reference uses 1.0; HF sets 1.0 when it folds a legacy flat
    # rope_scaling, but derives YaRN's mscale (0.1 ln(factor) + 1) for a nested
    # rope_parameters["compress"] that omits it, so we read it the way HF does.
    attention_factor: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    csa_rate: int = 4
    hca_rate: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2048
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    compress_yarn: YarnScaling | None = None
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    layer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    bos_token_id: int | None = 0
    eos_token_id: tuple[int, ...] = (1,)
    expert_dtype: str = "fp4"  # how routed experts are stored: "fp4" (MXFP4) or "dense"
    # Multi-token-prediction modules (native `mtp.{i}.*`, HF ignores them): each a V4 block of
    # its own (sliding-window attention: compress ratio 0; a learned router) between the
    # projections of the next token's embedding and the last layer's streams, and a head.
    num_nextn_predict_layers: int = 0
    # The LM head is the embedding where the checkpoint has no head of its own (HF's
    # _tied_weights_keys; save_pretrained leaves a tied head out).
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"ModelConfig.{name}: {why}")

        if self.head_dim != 512 or self.qk_rope_head_dim != 64:
            raise bad("head_dim", "zeroinfer's attention kernels implement the V4 geometry "
                      f"head_dim=512 with 64 RoPE dims, got {self.head_dim}/{self.qk_rope_head_dim}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise bad("layer_types", f"needs {self.num_hidden_layers} entries, got {len(self.layer_types)}")
        for t in self.layer_types:
            if t not in ATTENTION_TYPES:
                raise bad("layer_types", f"unknown layer type {t!r} (known: {', '.join(ATTENTION_TYPES)})")
        if len(self.mlp_layer_types) != self.num_hidden_layers:
            raise bad("mlp_layer_types", f"needs {self.num_hidden_layers} entries, got {len(self.mlp_layer_types)}")
        for t in self.mlp_layer_types:
            if t not in MLP_TYPES:
                raise bad("mlp_layer_types", f"unknown MLP type {t!r} (known: {', '.join(MLP_TYPES)})")
        if self.num_attention_heads % self.o_groups:
            raise bad("o_groups", f"must divide num_attention_heads={self.num_attention_heads}")
        if self.hidden_size % 32 or self.moe_intermediate_size % 32:
            raise bad("hidden_size", "hidden_size and moe_intermediate_size must be multiples of 32 "
                      "(MXFP4 scale blocks)")
        if self.expert_dtype not in ("fp4", "dense"):
            raise bad("expert_dtype", f"must be 'fp4' or 'dense', got {self.expert_dtype!r}")
        if self.num_nextn_predict_layers < 0:
            raise bad("num_nextn_predict_layers", f"must be >= 0, got {self.num_nextn_predict_layers}")

    def layer_kind(self, layer: int) -> str:
        """A block's attention type; blocks num_hidden_layers.. are the MTP modules' (sliding:
        DeepSeek's reference gives the next-n layers compress ratio 0)."""
        return self.layer_types[layer] if layer < self.num_hidden_layers else SLIDING

    def mlp_kind(self, layer: int) -> str:
        """A block's MoE router type; the MTP modules' is learned (they are past the hash
        layers)."""
        return self.mlp_layer_types[layer] if layer < self.num_hidden_layers else MOE

    def rate(self, layer: int) -> int:
        """Compression rate of a layer (0 for sliding-only layers)."""
        t = self.layer_kind(layer)
        return {SLIDING: 0, CSA: self.csa_rate, HCA: self.hca_rate}[t]

    @classmethod
    def from_hf_dict(cls, d: dict) -> ModelConfig:
        """Build from a config.json dict, accepting HF keys and the legacy DeepSeek ones
        (compress_ratios, num_hash_layers, qk_rope_head_dim, rope_scaling, compress_rate_*)."""
        n = int(d.get("num_hidden_layers", cls.num_hidden_layers))
        layer_types = d.get("layer_types")
        if layer_types is None and d.get("compress_ratios") is not None:
            ratios = d["compress_ratios"]
            unknown = [r for r in ratios if r not in _RATIO_TO_TYPE]
            if unknown:
                raise ValueError(f"config.json: compress_ratios has unknown ratio(s) {unknown}; "
                                 f"known: {sorted(_RATIO_TO_TYPE)}")
            layer_types = [_RATIO_TO_TYPE[r] for r in ratios]
        if layer_types is None:  # HF's fallback schedule (real checkpoints always give one)
            layer_types = [HCA] * min(n, 2) + [HCA if j % 2 == 0 else CSA for j in range(n - 2)]
        mlp_types = d.get("mlp_layer_types")
        if mlp_types is None:
            n_hash = int(d.get("num_hash_layers", 3))
            mlp_types = [HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash)
        rates = dict(d.get("compress_rates") or {})
        csa_rate = int(rates.get(CSA, d.get("compress_rate_csa", 4)))
        hca_rate = int(rates.get(HCA, d.get("compress_rate_hca", 128)))
        head_dim = int(d.get("head_dim", 512))
        if d.get("partial_rotary_factor") is not None:
            rope_dim = int(head_dim * float(d["partial_rotary_factor"]))
        else:
            rope_dim = int(d.get("qk_rope_head_dim", 64))
        # As HF reads them: a legacy `rope_scaling` wins over `rope_parameters`; only a dict
        # with both "main" and "compress" is nested. Otherwise the dict (legacy, or
        # transformers 5's flat form) is the compress table's scaling, whose base is
        # compress_rope_theta whatever rope_theta the dict holds (that is the main table's).
        rope_params = d.get("rope_scaling") or d.get("rope_parameters") or {}
        nested = (rope_params["compress"] if isinstance(rope_params.get("main"), dict)
                  and isinstance(rope_params.get("compress"), dict) else None)
        compress = nested or {k: v for k, v in rope_params.items()
                              if k not in ("main", "compress", "rope_theta")}
        yarn = None
        if compress.get("rope_type", compress.get("type")) == "yarn":
            if compress.get("factor") is None:
                raise ValueError("config.json: YaRN rope scaling without a 'factor'")
            factor = float(compress["factor"])
            att = compress.get("attention_factor")
            if att is None:
                att = _yarn_mscale(factor, compress) if nested else 1.0
            # (HF falls back to max_position_embeddings, whose default is V4's 1M)
            orig = compress.get("original_max_position_embeddings",
                                d.get("max_position_embeddings", 1 << 20))
            yarn = YarnScaling(
                factor=factor,
                original_max_position_embeddings=int(orig),
                beta_fast=float(compress.get("beta_fast") or 32.0),
                beta_slow=float(compress.get("beta_slow") or 1.0),
                attention_factor=float(att),
            )
        main = rope_params["main"] if nested else {}
        eos = d.get("eos_token_id", 1)
        quant = d.get("quantization_config") or {}
        # V4 ships expert_dtype at the top level ("fp4"; Flash-Base "fp8"), V4.1 in
        # quantization_config; HF copies the former into the latter unless it has its own.
        # Experts not in FP4 are "dense" to us (re-packed to MXFP4 at load if exact).
        given = quant.get("expert_dtype", d.get("expert_dtype"))
        expert_dtype = ("fp4" if quant else "dense") if given is None else \
            "fp4" if given == "fp4" else "dense"
        known = {f.name for f in fields(cls)}
        simple = {k: d[k] for k in (
            "vocab_size", "hidden_size", "num_attention_heads", "q_lora_rank", "o_groups",
            "o_lora_rank", "sliding_window", "index_n_heads", "index_head_dim", "index_topk",
            "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
            "routed_scaling_factor", "swiglu_limit", "rms_norm_eps", "hc_mult",
            "hc_sinkhorn_iters", "hc_eps", "bos_token_id", "num_nextn_predict_layers",
            "tie_word_embeddings")
            if k in d and k in known}
        return cls(
            **simple,
            num_hidden_layers=n,
            head_dim=head_dim,
            qk_rope_head_dim=rope_dim,
            csa_rate=csa_rate,
            hca_rate=hca_rate,
            rope_theta=float(main.get("rope_theta", d.get("rope_theta", 10000.0))),
            compress_rope_theta=float(compress.get("rope_theta", d.get("compress_rope_theta", 160000.0))),
            compress_yarn=yarn,
            layer_types=tuple(layer_types[:n]),
            mlp_layer_types=tuple(mlp_types[:n]),
            eos_token_id=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
            expert_dtype=expert_dtype,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        f = Path(path) / "config.json"
        if not f.is_file():
            raise FileNotFoundError(f"no config.json in checkpoint directory {path}")
        try:
            d = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{f}: not valid JSON ({e})") from e
        return cls.from_hf_dict(d)

    def to_hf_dict(self) -> dict:
        """An HF-style config.json dict (what DeepseekV4Config accepts)."""
        compress: dict = {"rope_type": "default", "rope_theta": self.compress_rope_theta,
                          "partial_rotary_factor": self.qk_rope_head_dim / self.head_dim}
        if self.compress_yarn is not None:
            y = self.compress_yarn
            compress.update(rope_type="yarn", factor=y.factor, beta_fast=y.beta_fast,
                            beta_slow=y.beta_slow, attention_factor=y.attention_factor,
                            original_max_position_embeddings=y.original_max_position_embeddings)
        return {
            "model_type": "deepseek_v4",
            "architectures": ["DeepseekV4ForCausalLM"],
            **{k: getattr(self, k) for k in (
                "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window",
                "index_n_heads", "index_head_dim", "index_topk", "n_routed_experts",
                "num_experts_per_tok", "moe_intermediate_size", "routed_scaling_factor",
                "swiglu_limit", "rms_norm_eps", "rope_theta", "compress_rope_theta", "hc_mult",
                "hc_sinkhorn_iters", "hc_eps", "bos_token_id", "num_nextn_predict_layers")},
            "num_key_value_heads": 1,
            "partial_rotary_factor": self.qk_rope_head_dim / self.head_dim,
            "compress_rates": {CSA: self.csa_rate, HCA: self.hca_rate},
            "layer_types": list(self.layer_types),
            "mlp_layer_types": list(self.mlp_layer_types),
            "rope_parameters": {
                "main": {"rope_type": "default", "rope_theta": self.rope_theta,
                         "partial_rotary_factor": self.qk_rope_head_dim / self.head_dim},
                "compress": compress,
            },
            "eos_token_id": list(self.eos_token_id),
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": 1 << 20,
        }
