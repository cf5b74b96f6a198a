"""Reference for moe_route: HF's router (DeepseekV4's `sqrtsoftplus` scores, the bias for
selection only, renormalised weights times the routed scaling factor) in plain torch, the scores
in the logits' dtype as HF computes them (../shared/reference/deepseek-v4-architecture.md)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def selection_scores(logits, bias):
    """What learned routing ranks: the sqrtsoftplus scores plus the selection-only bias."""
    return F.softplus(logits).sqrt() + bias


def moe_route_ref(logits, k, *, scale, bias=None, hash_table=None, input_ids=None):
    """(ids [T, k] int64, weights [T, k] float64) on the CPU; learned routing's ids in descending
    order of s + bias (torch.topk sorted; ties in torch's order)."""
    logits = logits.detach().cpu()
    s = F.softplus(logits).sqrt()
    if hash_table is not None:
        ids = hash_table.cpu()[input_ids.cpu()]
    else:
        ids = torch.topk(selection_scores(logits, bias.cpu()), k, dim=-1, sorted=True).indices
    w = s.gather(1, ids)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) * scale
    return ids, w.double()
