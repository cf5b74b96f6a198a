"""MoE dispatch (router top-k -> expert-sorted rows) and combine (weighted scatter back).

Layout produced by `moe_dispatch` and consumed by `mxfp4_grouped_gemm` (contiguous layout)
and `moe_combine`::

    rows:   0 .......... off[1] ......... off[2] ....        off[E] ... capacity
            | expert 0 rows | pad | expert 1 rows | pad | ... | unused      |
              count[0]            count[1]

Each segment starts at a multiple of `tile`; inside it rows are in (token, slot) order, a pure
function of the ids (deterministic, batch-invariant). The output sizes are upper bounds known
from the shapes alone (capacity = T*k + min(E, T*k)*(tile-1): at most that many experts get
a padded segment), so the CUDA path never waits for the host.
Padding rows have row_token = -1 and their activation rows are left unwritten.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zeroinfer import _C
from zeroinfer.ops._backend import dtype_code, ptr, stream_of, use_cuda
from zeroinfer.ops._checks import check_no_alias, check_positive_int, check_tensor

_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class MoeDispatch:
    sorted_x: torch.Tensor  # [capacity, D], x's dtype: rows grouped by expert
    row_token: torch.Tensor  # [capacity] int32: source token of each row, -1 for padding
    token_row: torch.Tensor  # [T, k] int32: row holding (t, j); -1 where topk_ids == -1
    expert_counts: torch.Tensor  # [E] int32: rows routed to each expert
    expert_offsets: torch.Tensor  # [E + 1] int32: tile-aligned segment starts; [E] = rows used


def moe_dispatch_capacity(num_tokens: int, topk: int, num_experts: int, tile: int = 1) -> int:
    """Rows of moe_dispatch's outputs: the most that any routing can need."""
    return _C.moe_dispatch_capacity(num_tokens, topk, num_experts, tile)


def moe_dispatch(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    *,
    tile: int = 1,
    out: MoeDispatch | None = None,
    check_ids: bool | None = None,
) -> MoeDispatch:
    """Sort the (token, slot) pairs of a top-k routing by expert and gather the activations.

    x: [T, D] float32 | bfloat16 | float8_e4m3fn. topk_ids: [T, k] int32 | int64 with values in
    [0, num_experts) or -1 (not routed here, e.g. an expert on another rank). tile: each
    expert's segment starts at a multiple of it (the grouped GEMM's M tile). Id ranges are
    checked for CPU tensors; for CUDA tensors only with check_ids=True (it syncs the host).
    out: optional preallocated MoeDispatch with the exact shapes (CUDA-graph friendly).
    """
    op = "moe_dispatch"
    check_tensor(op, "x", x, dtypes=(torch.float32, torch.bfloat16, torch.float8_e4m3fn), ndim=2)
    dev = x.device
    check_tensor(op, "topk_ids", topk_ids, dtypes=(torch.int32, torch.int64), ndim=2, device=dev)
    num_tokens, hidden = x.shape
    if topk_ids.shape[0] != num_tokens:
        raise ValueError(f"{op}: topk_ids must have shape [{num_tokens}, k] (one row per token "
                         f"of x), got {tuple(topk_ids.shape)}")
    topk = topk_ids.shape[1]
    check_positive_int(op, "num_experts", num_experts)
    check_positive_int(op, "tile", tile)
    capacity = moe_dispatch_capacity(num_tokens, topk, num_experts, tile)
    if capacity > _INT32_MAX:
        raise ValueError(f"{op}: T*k + min(E, T*k)*(tile-1) = {capacity} rows exceeds int32")
    cuda = use_cuda(dev, op)
    if (not cuda or check_ids) and topk_ids.numel():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < -1 or hi >= num_experts:
            raise ValueError(f"{op}: topk_ids values must be in [0, num_experts={num_experts}) "
                             f"or -1, got range [{lo}, {hi}]")
    if out is None:
        i32 = dict(dtype=torch.int32, device=dev)
        out = MoeDispatch(
            sorted_x=torch.empty(capacity, hidden, dtype=x.dtype, device=dev),
            row_token=torch.empty(capacity, **i32),
            token_row=torch.empty(num_tokens, topk, **i32),
            expert_counts=torch.empty(num_experts, **i32),
            expert_offsets=torch.empty(num_experts + 1, **i32),
        )
    else:
        check_tensor(op, "out.sorted_x", out.sorted_x, dtypes=(x.dtype,),
                     shape=(capacity, hidden), device=dev)
        for name, shape in (("row_token", (capacity,)), ("token_row", (num_tokens, topk)),
                            ("expert_counts", (num_experts,)),
                            ("expert_offsets", (num_experts + 1,))):
            check_tensor(op, f"out.{name}", getattr(out, name), dtypes=(torch.int32,),
                         shape=shape, device=dev)
        # every output: the kernel reads topk_ids after it has started writing row_token
        check_no_alias(op, {f"out.{f}": getattr(out, f) for f in MoeDispatch.__dataclass_fields__},
                       {"x": x, "topk_ids": topk_ids})
    workspace = None
    if cuda:
        nbytes = _C.moe_dispatch_workspace_bytes(num_tokens, topk, num_experts)
        workspace = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    _C.moe_dispatch(cuda, ptr(x), dtype_code(x), ptr(topk_ids), dtype_code(topk_ids), num_tokens,
                    hidden, topk, num_experts, tile, capacity, ptr(out.sorted_x),
                    ptr(out.row_token), ptr(out.token_row), ptr(out.expert_counts),
                    ptr(out.expert_offsets), ptr(workspace), stream_of(dev))
    return out


def moe_combine(
    expert_out: torch.Tensor,
    token_row: torch.Tensor | None,
    topk_weights: torch.Tensor,
    *,
    topk_ids: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * expert_out[token_row[t, j]], j = 0..k-1 in order,
    accumulated in float32 (a fixed order: results do not depend on the batch).

    expert_out: [rows, D] float32 | bfloat16 in dispatch order. token_row: [T, k] int32 from
    moe_dispatch (-1 adds nothing). topk_weights: [T, k] float32 | bfloat16. Returns [T, D] in
    out_dtype (default: expert_out's dtype).

    Routed layout (``mxfp4_grouped_gemm(..., topk_ids=...)``, no dispatch): token_row None and
    topk_ids the routing ids [T, k] int32; expert_out has T*k rows in (token, slot) order, so
    slot (t, j) reads row t*k + j, and nothing where topk_ids[t, j] is -1.
    """
    op = "moe_combine"
    check_tensor(op, "expert_out", expert_out, dtypes=(torch.float32, torch.bfloat16), ndim=2)
    dev = expert_out.device
    if (token_row is None) == (topk_ids is None):
        raise ValueError(f"{op}: pass token_row (from moe_dispatch) or, for the routed layout, "
                         "token_row=None and topk_ids; got "
                         + ("both" if topk_ids is not None else "neither"))
    routed = topk_ids is not None
    rows_of = topk_ids if routed else token_row
    name = "topk_ids" if routed else "token_row"
    check_tensor(op, name, rows_of, dtypes=(torch.int32,), ndim=2, device=dev)
    num_tokens, topk = rows_of.shape
    check_tensor(op, "topk_weights", topk_weights, dtypes=(torch.float32, torch.bfloat16),
                 shape=(num_tokens, topk), device=dev)
    rows, hidden = expert_out.shape
    if routed and rows != num_tokens * topk:
        raise ValueError(f"{op}: in the routed layout expert_out must have T*k = "
                         f"{num_tokens * topk} rows (one a slot of topk_ids "
                         f"{tuple(topk_ids.shape)}), got {rows}")
    out_dtype = out_dtype or expert_out.dtype
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"{op}: out_dtype must be float32 or bfloat16, got {out_dtype}")
    cuda = use_cuda(dev, op)
    if not cuda and not routed and token_row.numel():
        lo, hi = int(token_row.min()), int(token_row.max())
        if lo < -1 or hi >= rows:
            raise ValueError(f"{op}: token_row values must be in [0, rows of expert_out={rows}) "
                             f"or -1, got range [{lo}, {hi}]")
    if out is None:
        out = torch.empty(num_tokens, hidden, dtype=out_dtype, device=dev)
    else:
        check_tensor(op, "out", out, dtypes=(out_dtype,), shape=(num_tokens, hidden), device=dev)
        check_no_alias(op, {"out": out}, {"expert_out": expert_out, name: rows_of,
                                          "topk_weights": topk_weights})
    _C.moe_combine(cuda, ptr(expert_out), dtype_code(expert_out), ptr(rows_of),
                   ptr(topk_weights), dtype_code(topk_weights), rows, num_tokens, hidden, topk,
                   ptr(out), dtype_code(out), routed, stream_of(dev))
    return out
