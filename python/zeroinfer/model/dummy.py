"""Tiny DeepSeek-V4 configurations with seeded random weights, made on the fly (no download).
They keep the real attention geometry (head_dim 512, 64 RoPE dims, K=V) and every branch of
the graph; everything else is small. Every parameter that defaults to zero or identity
(norm weights, sinks, biases, ape, hc base/scale) is randomised so each branch matters.
"""

from __future__ import annotations

import math

import torch

from zeroinfer.model.config import CSA, HASH_MOE, HCA, MOE, SLIDING, ModelConfig, YarnScaling
from zeroinfer.model.deepseek_v4 import DeepseekV4ForCausalLM

_SMALL = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, q_lora_rank=32, o_groups=2,
              o_lora_rank=32, index_n_heads=8, index_head_dim=128, n_routed_experts=8,
              num_experts_per_tok=2, moe_intermediate_size=64, hc_mult=4, bos_token_id=0,
              eos_token_id=(1,), num_nextn_predict_layers=1)

DUMMY_CONFIGS: dict[str, ModelConfig] = {
    # the embedded default: all three attention types and both MoE kinds, and the real V4
    # vocabulary so the real tokenizer's ids are valid
    "tiny": ModelConfig(**{**_SMALL, "vocab_size": 129280}, num_hidden_layers=4, sliding_window=8, csa_rate=4, hca_rate=16,
                        index_topk=3, layer_types=(SLIDING, CSA, HCA, CSA),
                        mlp_layer_types=(HASH_MOE, MOE, MOE, MOE)),
    # more layers, HCA first, a wider window and YaRN on the compress RoPE table
    "tiny-yarn": ModelConfig(**_SMALL, num_hidden_layers=5, sliding_window=16, csa_rate=4,
                             hca_rate=8, index_topk=5, layer_types=(HCA, CSA, SLIDING, CSA, HCA),
                             mlp_layer_types=(HASH_MOE, HASH_MOE, MOE, MOE, MOE),
                             compress_yarn=YarnScaling(factor=16.0, original_max_position_embeddings=64)),
}


def _random_mxfp4(gen: torch.Generator, *shape_nk: int, fan_in: int):
    """Random packed e2m1 bytes (every nibble value) and UE8M0 scales sized so the
    dequantized weights have rms about 1/sqrt(fan_in)."""
    *lead, n, k = shape_nk
    blocks = torch.randint(0, 256, (*lead, n, k // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    centre = 127 + round(math.log2(1 / (2.93 * math.sqrt(fan_in))))
    scales = torch.randint(centre - 1, centre + 2, (*lead, n, k // 32), generator=gen,
                           dtype=torch.int32).to(torch.uint8)
    return blocks, scales


def random_state_dict(config: ModelConfig, seed: int = 0, *,
                      mtp: bool = False) -> dict[str, torch.Tensor]:
    """Seeded random weights for every tensor of the graph (float32 / uint8 / int64); with mtp
    the MTP modules' too, made last (the main model's are the same either way)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        net = DeepseekV4ForCausalLM(config, torch.float32, mtp=mtp)
    out: dict[str, torch.Tensor] = {}
    c = config
    for name, t in net.state_dict().items():
        leaf = name.rsplit(".", 1)[-1]
        shape = tuple(t.shape)
        if name.endswith("experts.gate_up_blocks"):
            out[name], out[name.replace("blocks", "scales")] = _random_mxfp4(
                gen, c.n_routed_experts, 2 * c.moe_intermediate_size, c.hidden_size, fan_in=c.hidden_size)
        elif name.endswith("experts.down_blocks"):
            out[name], out[name.replace("blocks", "scales")] = _random_mxfp4(
                gen, c.n_routed_experts, c.hidden_size, c.moe_intermediate_size,
                fan_in=c.moe_intermediate_size)
        elif name.endswith("_scales"):
            continue  # made with its blocks
        elif leaf == "tid2eid":
            out[name] = torch.randint(0, c.n_routed_experts, shape, generator=gen)
        elif leaf == "e_score_correction_bias":
            out[name] = 0.3 * torch.randn(shape, generator=gen)
        elif leaf == "sinks":
            out[name] = torch.randn(shape, generator=gen)
        elif leaf == "position_bias":
            out[name] = 0.5 * torch.randn(shape, generator=gen)
        elif name.endswith("_hc.fn") or leaf == "hc_fn":
            out[name] = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
        elif name.endswith("_hc.base") or leaf == "hc_base":
            out[name] = 0.5 * torch.randn(shape, generator=gen)
        elif name.endswith("_hc.scale") or leaf == "hc_scale":
            out[name] = 0.5 + torch.rand(shape, generator=gen)
        elif name.endswith("norm.weight") or "norm" in name.rsplit(".", 2)[-2]:
            out[name] = 1 + 0.2 * torch.randn(shape, generator=gen)
        elif name.endswith("embed_tokens.weight"):
            out[name] = torch.randn(shape, generator=gen)
        elif len(shape) == 2:  # projections
            out[name] = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
        else:
            raise AssertionError(f"dummy weights: no rule for {name} {shape}")
    return out


def dummy_config(name: str) -> ModelConfig:
    if name not in DUMMY_CONFIGS:
        raise ValueError(f"unknown dummy model {name!r}; known: {', '.join(DUMMY_CONFIGS)}")
    return DUMMY_CONFIGS[name]
