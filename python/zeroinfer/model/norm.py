"""The two RMS norms of V4, with HF's precision rules, each one launch of ops.rms_norm (their
torch forms, the model's before: zeroinfer.testing.torch_forms)."""

from __future__ import annotations

import torch

from zeroinfer import ops
from zeroinfer.model.linear import empty_rows


def _out(x: torch.Tensor) -> torch.Tensor:
    # The output's storage holds whole tiles of rows: a linear that reads it pads for free.
    return empty_rows(tuple(x.shape), x.dtype, x.device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Weighted: normalise in float32, multiply by the (float32) weight, cast back once."""
    return ops.rms_norm(x, weight if weight.dtype == torch.float32 else weight.float(), eps,
                        out=_out(x))


def rms_norm_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    """No weight: x * rsqrt(mean(x^2) + eps) with the factor cast to x's dtype (q_b_norm, mHC)."""
    return ops.rms_norm(x, None, eps, out=_out(x))
