"""V4's two RMS norms over the last dim in one launch (HF's precision rules; each torch form was
7-9 calls):

    weighted:    y = (weight * (x * r)).to(x.dtype)      weight float32 [D]
    unweighted:  y = x * r.to(x.dtype)                   (weight None)

with r = 1 / sqrt(mean(x^2) + eps) and x widened to float32. The sum of squares runs in one fixed
order (256 strided lane sums folded pairwise, every step rounded on its own), so a row's result
depends on the row alone - batch-invariant - and the CPU twin and the CUDA kernel agree bitwise;
torch's forms sum in their own order, so against them the last bits may differ.
"""

from __future__ import annotations

import torch

from zeroinfer import _C
from zeroinfer.ops._backend import dtype_code, ptr, stream_of, use_cuda
from zeroinfer.ops._checks import check_float, check_no_alias, check_tensor, row_stride


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """The RMS norm of x [..., D] over D (definition in the module doc).

    x: float32 or bfloat16, D >= 1, contiguous - or a 2-D [rows, D] whose rows are unit-stride
    and evenly spaced (a column slice of a wider matrix, as FusedLinears' outputs are); weight:
    float32 [D] on x's device, or None for the unweighted norm; eps: finite, >= 0. Returns a new
    contiguous tensor, or fills `out` (x's shape and dtype, contiguous; it may not overlap the
    inputs).
    """
    op = "rms_norm"
    stride = row_stride(x)
    check_tensor(op, "x", x, dtypes=(torch.float32, torch.bfloat16), contiguous=stride is None)
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"{op}: x must be [..., D] with D >= 1, got shape {tuple(x.shape)}")
    dim = x.shape[-1]
    if weight is not None:
        check_tensor(op, "weight", weight, dtypes=(torch.float32,), shape=(dim,), device=x.device)
    eps = check_float(op, "eps", eps)
    if eps < 0:
        raise ValueError(f"{op}: eps must be >= 0, got {eps}")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        check_tensor(op, "out", out, dtypes=(x.dtype,), shape=tuple(x.shape), device=x.device)
        check_no_alias(op, {"out": out}, {"x": x, "weight": weight})
    _C.rms_norm(use_cuda(x.device, op), x.numel() // dim, dim, dim if stride is None else stride,
                dtype_code(x), eps,
                ptr(x), ptr(weight), ptr(out), stream_of(x.device))
    return out
