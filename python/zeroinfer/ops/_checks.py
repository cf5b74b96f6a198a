"""Argument checks shared by every op. Each failure names the argument and what was expected,
because the C++ behind the op trusts what it is given."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def row_stride(x: object) -> int | None:
    """The row stride of a 2-D tensor whose rows are unit-stride and evenly spaced (contiguous,
    or a column slice of a wider matrix, as FusedLinears' outputs are), else None: the ops that
    take such rows (rms_norm, moe_route) check the rest of x as contiguous."""
    if (isinstance(x, torch.Tensor) and x.dim() == 2 and x.stride(1) == 1
            and x.stride(0) >= x.shape[1]):
        return x.stride(0)
    return None


def check_tensor(
    op: str,
    name: str,
    t: object,
    *,
    dtypes: Sequence[torch.dtype],
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | None = None,
    contiguous: bool = True,
) -> torch.Tensor:
    """Validate one tensor argument; returns it. `shape` entries of None match any size."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{op}: {name} must have dtype {want}, got {str(t.dtype).replace('torch.', '')}")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{op}: {name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        for i, (got, want) in enumerate(zip(t.shape, shape)):
            if want is not None and got != want:
                expect = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
                raise ValueError(
                    f"{op}: {name} must have shape {expect}, got {tuple(t.shape)} (dim {i})"
                )
    if device is not None and t.device != device:
        raise ValueError(f"{op}: {name} must be on {device} like the other inputs, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous (call .contiguous() first)")
    return t


def check_positive_int(op: str, name: str, v: object, *, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{op}: {name} must be an int, got {type(v).__name__}")
    if v < minimum:
        raise ValueError(f"{op}: {name} must be >= {minimum}, got {v}")
    return v


# The kernels take these arguments as float32: from 2^128 - 2^103 up a magnitude rounds to inf
# there, and a positive value up to 2^-150 rounds to 0 (round to nearest even).
_F32_ROUNDS_TO_INF = 2.0**128 - 2.0**103
_F32_ROUNDS_TO_ZERO = 2.0**-150


def check_float(op: str, name: str, v: object, *, positive: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{op}: {name} must be a float, got {type(v).__name__}")
    v = float(v)
    if v != v or abs(v) >= _F32_ROUNDS_TO_INF:
        raise ValueError(f"{op}: {name} must be finite as a float32 (|v| < 3.4e38), got {v}")
    if positive and v <= _F32_ROUNDS_TO_ZERO:
        raise ValueError(f"{op}: {name} must be > 0 as a float32 (v > 2^-150), got {v}")
    return v


def check_no_alias(op: str, outputs: dict[str, torch.Tensor],
                   inputs: dict[str, torch.Tensor | None]) -> None:
    """Outputs must not overlap inputs in memory (the kernels read inputs while writing)."""

    def span(t: torch.Tensor) -> tuple[int, int]:
        # the bytes from the first element to the last (a strided view reaches past numel)
        start = t.data_ptr()
        last = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
        return start, start + (last + 1) * t.element_size()

    for on, o in outputs.items():
        if o.numel() == 0:
            continue
        o0, o1 = span(o)
        for iname, i in inputs.items():
            if i is None or i.numel() == 0 or i.device != o.device:
                continue
            i0, i1 = span(i)
            if o0 < i1 and i0 < o1:
                raise ValueError(f"{op}: output {on} must not alias input {iname}")
