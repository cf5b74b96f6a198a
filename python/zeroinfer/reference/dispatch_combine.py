"""Float64 references for moe_dispatch / moe_combine (the contract is in ops/dispatch_combine.py).

Written as the plain definition: a stable sort of the (token, slot) pairs by expert id.
"""

from __future__ import annotations

import torch


def moe_dispatch_ref(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, *, tile: int = 1):
    """Returns (sorted_x, row_token, token_row, expert_counts, expert_offsets) with sorted_x in
    float64, padding rows of sorted_x zero (the op leaves them unwritten)."""
    T, k = topk_ids.shape
    ids = topk_ids.cpu().long().reshape(-1)
    valid = ids >= 0
    counts = torch.bincount(ids[valid], minlength=num_experts)
    padded = (counts + tile - 1) // tile * tile
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(padded, 0)])
    # A stable sort by expert keeps (token, slot) order inside each expert.
    order = torch.sort(torch.where(valid, ids, num_experts), stable=True).indices
    order = order[: int(valid.sum())]
    first_sorted = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(counts, 0)])
    sorted_expert = ids[order]
    rank = torch.arange(order.numel()) - first_sorted[sorted_expert]
    rows = offsets[sorted_expert] + rank
    capacity = T * k + min(num_experts, T * k) * (tile - 1)
    token_row = torch.full((T * k,), -1, dtype=torch.long)
    token_row[order] = rows
    row_token = torch.full((capacity,), -1, dtype=torch.long)
    row_token[rows] = order // k
    sorted_x = torch.zeros(capacity, x.shape[1], dtype=torch.float64)
    sorted_x[rows] = x.cpu().double()[order // k]
    i32 = torch.int32
    return (sorted_x, row_token.to(i32), token_row.view(T, k).to(i32), counts.to(i32),
            offsets.to(i32))


def moe_combine_ref(expert_out: torch.Tensor, token_row: torch.Tensor | None,
                    topk_weights: torch.Tensor, *, topk_ids: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """float64 [T, D]: sum over slots of weight * expert row (-1 rows skipped). Routed layout
    (token_row None): slot (t, j) is row t*k + j, skipped where topk_ids[t, j] < 0."""
    eo = expert_out.cpu().double()
    if topk_ids is not None:
        ids = topk_ids.cpu().long()
        slot = torch.arange(ids.numel()).reshape(ids.shape)
        token_row = torch.where(ids >= 0, slot, -1)
    rows = token_row.cpu().long()
    w = topk_weights.cpu().double()
    out = torch.zeros(rows.shape[0], eo.shape[1], dtype=torch.float64)
    for t in range(rows.shape[0]):
        for j in range(rows.shape[1]):
            if rows[t, j] >= 0:
                out[t] += w[t, j] * eo[rows[t, j]]
    return out
