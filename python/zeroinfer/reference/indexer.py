"""Reference for indexer_scores in float64: the lightning indexer's scores of each query token
over its sequence's compressed entries in the paged cache
(../shared/reference/deepseek-v4-architecture.md, "Lightning indexer")."""

from __future__ import annotations

import torch


def indexer_scores_ref(q, weights, keys, block_table, seq_of_token, visible, num_entries, *,
                       scale):
    """Scores [T, num_entries] float64 on the CPU; -inf past each token's visible entries."""
    q, weights = q.detach().cpu().double(), weights.detach().cpu().double()
    flat = keys.detach().cpu().double().reshape(-1, keys.shape[-1])
    table, block = block_table.cpu().long(), keys.shape[1]
    out = torch.full((q.shape[0], num_entries), float("-inf"), dtype=torch.float64)
    for t in range(q.shape[0]):
        n = min(max(int(visible[t]), 0), num_entries)
        s = torch.arange(n)
        k = flat[table[int(seq_of_token[t]), s // block] * block + s % block]  # [n, d]
        dots = torch.relu(q[t] @ k.T)  # [H, n]
        out[t, :n] = scale * (weights[t][:, None] * dots).sum(0)
    return out
