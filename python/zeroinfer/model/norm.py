"""The two RMS norms of V4, with HF's precision rules, each one launch of ops.rms_norm (their
torch forms, the model's before: zeroinfer.testing.torch_forms)."""

from __future__ import annotations

import torch

from zeroinfer import ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Weighted: normalise in float32, multiply by the (float32) weight, cast back once."""
    return ops.rms_norm(x, weight if weight.dtype == torch.float32 else weight.float(), eps)


def rms_norm_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    """No weight: x * rsqrt(mean(x^2) + eps) with the factor cast to x's dtype (q_b_norm, mHC)."""
    return ops.rms_norm(x, None, eps)
