"""Reference for rms_norm in float64: V4's weighted and unweighted RMS norms
(../shared/reference/deepseek-v4-architecture.md)."""

from __future__ import annotations

import torch


def rms_norm_ref(x, weight, eps):
    """x [..., D] normalised over D, float64 on the CPU (weight None: the unweighted norm)."""
    x = x.detach().cpu().double()
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.detach().cpu().double()
