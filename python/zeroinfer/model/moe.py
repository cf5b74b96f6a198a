"""V4 MoE block: a router (learned top-k with a selection-only bias, or a frozen token-id hash),
MXFP4 routed experts through zeroinfer.ops (dispatch -> grouped GEMM with fused clamped SwiGLU
-> grouped GEMM -> weighted combine; small batches skip the dispatch: the GEMMs take the ids),
and one always-on shared expert. Under expert parallelism (zeroinfer.parallel) the routed
experts are this rank's slots and the tokens travel to the ranks holding their experts."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from zeroinfer import ops
from zeroinfer.model.config import HASH_MOE, ModelConfig
from zeroinfer.model.linear import FusedLinears, Linear, pad_rows

if TYPE_CHECKING:
    from zeroinfer.parallel import ExpertParallel


class Router(nn.Module):
    def __init__(self, config: ModelConfig, hashed: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.hashed, self.k, self.rho = hashed, config.num_experts_per_tok, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size, dtype=dtype))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.k, dtype=torch.int64))
        else:
            self.register_buffer("e_score_correction_bias",
                                 torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def route(self, logits: torch.Tensor, input_ids: torch.Tensor):
        """(expert ids [T, k] int32, weights [T, k] float32) from the router logits [T, E]
        (y @ weight^T, made by the MoE's one GEMM): "sqrtsoftplus" scores, the top k by score +
        bias (the bias only chooses) or the token's row of the hash table, the chosen scores
        renormalised times rho - one ops.moe_route launch."""
        if self.hashed:
            return ops.moe_route(logits, self.k, scale=self.rho, hash_table=self.tid2eid,
                                 input_ids=input_ids)
        return ops.moe_route(logits, self.k, scale=self.rho, bias=self.e_score_correction_bias)


class Experts(nn.Module):
    """Routed experts, packed MXFP4 as in V4 checkpoints (kept packed for the FP4 GEMM).
    gate_up rows 0..I-1 are the gate (w1), rows I..2I-1 the up projection (w3). `num_slots`
    experts are held: all of them, or this rank's physical slots under expert parallelism."""

    def __init__(self, config: ModelConfig, num_slots: int | None = None) -> None:
        super().__init__()
        D, I = config.hidden_size, config.moe_intermediate_size
        E = self.num_slots = num_slots or config.n_routed_experts
        u8 = dict(dtype=torch.uint8)
        self.register_buffer("gate_up_blocks", torch.zeros(E, 2 * I, D // 2, **u8))
        self.register_buffer("gate_up_scales", torch.zeros(E, 2 * I, D // 32, **u8))
        self.register_buffer("down_blocks", torch.zeros(E, D, I // 2, **u8))
        self.register_buffer("down_scales", torch.zeros(E, D, I // 32, **u8))
        self._packed: tuple[ops.Mxfp4PackedWeights, ops.Mxfp4PackedWeights] | None = None
        self._packed_key: tuple | None = None

    def packed(self) -> tuple[ops.Mxfp4PackedWeights, ops.Mxfp4PackedWeights] | None:
        """(gate_up, down) in the CUDA kernel's layout for bf16 activations (ops.mxfp4_prepack),
        built once and rebuilt only if the buffers change (moved or overwritten); None off CUDA.
        The buffers stay as loaded (checkpoint layout, state_dict unchanged), so on CUDA the
        routed-expert weights are held twice."""
        bufs = (self.gate_up_blocks, self.gate_up_scales, self.down_blocks, self.down_scales)
        if bufs[0].device.type != "cuda":
            return None
        key = tuple((b.data_ptr(), b._version) for b in bufs)
        if self._packed_key != key:
            self._packed = (ops.mxfp4_prepack(bufs[0], bufs[1], fuse_swiglu=True,
                                              act_dtype=torch.bfloat16),
                            ops.mxfp4_prepack(bufs[2], bufs[3], act_dtype=torch.bfloat16))
            self._packed_key = key
        return self._packed

    def buffers_of_slots(self) -> tuple[torch.Tensor, ...]:
        """The four checkpoint-layout buffers, slot-major (what expert parallelism moves)."""
        return self.gate_up_blocks, self.gate_up_scales, self.down_blocks, self.down_scales

    def run(self, y: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
            limit: float) -> torch.Tensor:
        """sum_j w[t, j] * expert_{ids[t, j]}(y[t]) [T, D] in y's dtype; ids [T, k] int32 in
        [0, num_slots) or -1 (adds nothing)."""
        pk = self.packed() if y.dtype == torch.bfloat16 else None  # CUDA: prepacked once
        w1, s1 = (pk[0], None) if pk else (self.gate_up_blocks, self.gate_up_scales)
        w2, s2 = (pk[1], None) if pk else (self.down_blocks, self.down_scales)
        if ids.numel() <= ops.MXFP4_ROUTED_MAX_ROWS:
            # Decode: the GEMMs read the ids and sort them themselves (the routed layout, rows
            # in (token, slot) order), so no dispatch launch precedes them; the same results.
            x, seg, rows = y.contiguous(), dict(topk_ids=ids), dict(token_row=None, topk_ids=ids)
        else:
            d = ops.moe_dispatch(y.contiguous(), ids, self.num_slots)
            x, rows = d.sorted_x, dict(token_row=d.token_row)
            seg = dict(expert_offsets=d.expert_offsets, expert_counts=d.expert_counts)
        h = ops.mxfp4_grouped_gemm(x, w1, s1, fuse_swiglu=True, swiglu_limit=limit,
                                   out_dtype=y.dtype, **seg)
        o = ops.mxfp4_grouped_gemm(h, w2, s2, out_dtype=y.dtype, **seg)
        return ops.moe_combine(o, topk_weights=w, out_dtype=y.dtype, **rows)


class SharedExpert(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        D, I = config.hidden_size, config.moe_intermediate_size
        self.gate_proj = Linear(D, I, dtype)
        self.up_proj = Linear(D, I, dtype)
        self.down_proj = Linear(I, D, dtype)

    def finish(self, gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
        """V4's clamped SwiGLU of the gate / up projections (the MoE's one GEMM), then down:
        down(silu(min(gate, limit)) * clamp(up, -limit, limit))."""
        # On the GEMM's padded rows (views: gate / up are column slices of its output), so
        # that down_proj's input is padded already.
        (gate, n), (up, _) = pad_rows(gate), pad_rows(up)
        return self.down_proj(F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit))[:n]


class MoE(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype,
                 ep: ExpertParallel | None = None) -> None:
        super().__init__()
        self.config, self.layer, self.ep = config, layer, ep
        self.gate = Router(config, config.mlp_kind(layer) == HASH_MOE, dtype)
        self.experts = Experts(config, ep.slots if ep is not None else None)
        self.shared_experts = SharedExpert(config, dtype)
        # The router's logits and the shared expert's gate / up: one GEMM of the input.
        sh = self.shared_experts
        self.y_proj = FusedLinears(self.gate, sh.gate_proj, sh.up_proj)

    def routed(self, y: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
               token_keys: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum for the (logical) routing ids, here or, under
        expert parallelism, across the group (a collective; token_keys pick the replicas)."""
        lam = self.config.swiglu_limit
        if self.ep is None:
            return self.experts.run(y, ids, w, lam)
        return self.ep.run(self.layer, y, ids, w, token_keys,
                           lambda x, i, ww: self.experts.run(x, i, ww, lam))

    def forward(self, y: torch.Tensor, input_ids: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
        sh = self.shared_experts
        logits, gate, up = self.y_proj(y)
        ids, w = self.gate.route(logits, input_ids)
        keys = input_ids.long() * _POSITIONS + positions.long() if self.ep is not None else None
        return self.routed(y, ids, w, keys) + sh.finish(gate, up, self.config.swiglu_limit)


# A token's replica key under expert parallelism: its id and position, one int64.
_POSITIONS = 1 << 24
