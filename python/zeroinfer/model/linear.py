"""Batch-invariant dense layers and row padding.

BLAS libraries pick different kernels for different row counts (on this CPU torch's GEMM gives
bitwise different rows for M in {1, 2, 3, 5, 7} than for larger M), so a token's result would
depend on how many other tokens share its batch or chunk. Padding the rows to a multiple of
ROW_TILE keeps every call on the same kernel family, which makes each row's result independent
of the batch: the property the engine's async == sync guarantee and deterministic serving rest
on (tests/model/test_batch_invariance.py checks it bitwise).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ROW_TILE = 16


def tile_rows(n: int) -> int:
    """n rounded up to a whole number of ROW_TILE rows."""
    return n + (-n) % ROW_TILE


def pad_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x [n, ...] with its rows made a multiple of ROW_TILE, and n. Where x's storage goes on
    past its rows at the same strides (a tensor made by empty_rows, or the first rows or a
    column slice of a padded GEMM's output), the extra rows are a view of what is there: no
    launch. Their values do not matter - a GEMM's or an elementwise op's rows are independent,
    and these are dropped. Otherwise zero rows are appended (F.pad: an allocation, a fill and a
    copy on a GPU)."""
    n = x.shape[0]
    pad = (-n) % ROW_TILE
    if not pad:
        return x, n
    inner = sum((size - 1) * stride for size, stride in zip(x.shape[1:], x.stride()[1:]))
    row_apart = all(size > 0 for size in x.shape[1:]) and x.stride(0) > inner
    last = x.storage_offset() + (n + pad - 1) * x.stride(0) + inner  # the view's last element
    if n and row_apart and (last + 1) * x.element_size() <= x.untyped_storage().nbytes():
        return x.as_strided((n + pad, *x.shape[1:]), x.stride()), n
    return F.pad(x, (0, 0) * (x.dim() - 1) + (0, pad)), n


def empty_rows(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor of `shape` whose storage holds tile_rows(shape[0]) rows, so that
    pad_rows extends it for free (for outputs that feed a linear)."""
    buf = torch.empty((tile_rows(shape[0]), *shape[1:]), dtype=dtype, device=device)
    return buf[: shape[0]]


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T with the leading dims flattened and padded to ROW_TILE rows."""
    if x.dim() == 2:  # the common case, in as few torch calls as the padding allows
        flat, n = pad_rows(x)
        y = F.linear(flat, weight)
        return y if flat is x else y[:n]
    lead = x.shape[:-1]
    flat, n = pad_rows(x.reshape(-1, x.shape[-1]))
    return F.linear(flat, weight)[:n].reshape(*lead, weight.shape[0])


class Linear(nn.Linear):
    """nn.Linear without bias whose forward is batch-invariant (same state-dict names)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__(in_features, out_features, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class FusedLinears:
    """Linears that read one input, computed by one GEMM over their weights' rows stacked: on a
    GPU each GEMM is a launch and a few Python calls, and a decode step is bound by those.

    The first call stacks the weights into one [sum N, K] tensor and makes each linear's weight
    a view of its rows, so they share that storage (state_dict and loading still see each
    linear's own weight; memory is not doubled). If a weight is replaced or moved later, the
    next call stacks them again. Returns the outputs as column slices of the one result (views,
    not contiguous: for consumers that take strided tensors)."""

    def __init__(self, *modules: nn.Module) -> None:
        self.modules = modules
        self.sizes = [m.weight.shape[0] for m in modules]
        self.weight: torch.Tensor | None = None

    def stacked(self) -> torch.Tensor:
        w, row = self.weight, 0
        if w is not None:  # is each weight still its rows of w? (pointer arithmetic: no op)
            base, pitch = w.data_ptr(), w.stride(0) * w.element_size()
            for m, n in zip(self.modules, self.sizes):
                p = m.weight
                if p.device != w.device or p.data_ptr() != base + row * pitch or p.shape[0] != n:
                    w = None
                    break
                row += n
        if w is None:
            w = torch.cat([m.weight.detach() for m in self.modules])
            row = 0
            for m, n in zip(self.modules, self.sizes):
                m.weight = nn.Parameter(w[row:row + n], requires_grad=False)
                row += n
            self.weight = w
        return w

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return linear(x, self.stacked()).split(self.sizes, dim=-1)
