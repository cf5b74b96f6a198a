"""A plain streaming read of chosen rows of a tensor in one launch (Triton): the time a kernel
that does nothing but read those bytes takes.

The benchmarks' floors divide bytes by the *asymptotic* copy rate (a 1 GiB copy). A launch that
moves a few tens of MB cannot reach that rate: its CTAs start, its first bytes arrive a DRAM
round trip later, its last CTAs drain alone. Timed the same way as the kernel it sits beside
(L2 flushed, kernel time), this read says how much of a case's gap to its floor any single
launch over the same bytes would show, and how much is the kernel's own.

Triton comes with torch's CUDA wheels on Linux (their `triton` dependency) and is not a
dependency of ours: the CPU path never needs it, and without it best_read_seconds is None.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None

if triton is not None:

    @triton.jit
    def _read_rows(x_ptr, rows_ptr, out_ptr, row_words, chunks_per_row, total_chunks,
                   BLOCK: tl.constexpr):
        # Grid-stride over (row, chunk) pairs in order, so neighbouring programs read
        # neighbouring chunks; int32 sums kept per program and stored so nothing is elided.
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for c in range(pid, total_chunks, tl.num_programs(0)):
            r = c // chunks_per_row
            offs = (c - r * chunks_per_row) * BLOCK + tl.arange(0, BLOCK)
            row = tl.load(rows_ptr + r).to(tl.int64)
            acc += tl.load(x_ptr + row * row_words + offs, mask=offs < row_words, other=0,
                           cache_modifier=".cg")
        tl.store(out_ptr + pid * BLOCK + tl.arange(0, BLOCK), acc)


def available() -> bool:
    return triton is not None


def reader(x: torch.Tensor, rows: torch.Tensor, *, programs: int,
           block: int) -> tuple[Callable[[], None], torch.Tensor]:
    """(fn, partial sums): fn() reads rows `rows` (int32, any order) of x viewed as
    [x.shape[0], row bytes] in one launch of `programs` programs of `block` int32 words a step,
    into the partial sums [programs * block] (int32, wrapping; their total is the rows' int32
    sum mod 2**32: what the test checks)."""
    if triton is None:
        raise RuntimeError("zeroinfer.testing.stream_read needs Triton")
    if not x.is_contiguous() or x.dim() < 1:
        raise ValueError("x must be a contiguous tensor with a leading row dimension")
    row_bytes = x[0].numel() * x.element_size() if x.shape[0] else 0
    if row_bytes % 4:
        raise ValueError(f"a row of x must be a whole number of int32 words, got {row_bytes} bytes")
    if x.data_ptr() % 4:
        raise ValueError("x must start on a 4-byte boundary")
    if rows.dtype != torch.int32 or rows.dim() != 1 or rows.device != x.device:
        raise ValueError("rows must be a 1-D int32 tensor on x's device")
    words = x.view(torch.uint8).view(-1).view(torch.int32)
    row_words = row_bytes // 4
    chunks = -(-row_words // block)
    out = torch.empty(programs * block, dtype=torch.int32, device=x.device)
    total = chunks * rows.numel()

    def fn() -> None:
        _read_rows[(programs,)](words, rows, out, row_words, chunks, total, BLOCK=block)

    return fn, out


def best_read_seconds(x: torch.Tensor, rows: torch.Tensor,
                      timer: Callable[[Callable[[], None]], float]) -> float | None:
    """The fastest of four grid shapes (4 or 16 programs an SM, 1K or 4K words a step) reading rows
    `rows` of x, each timed by `timer` (e.g. bench.time_kernels); None without Triton."""
    if triton is None:
        return None
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    best = None
    for per_sm in (4, 16):
        for block in (1024, 4096):
            fn, _ = reader(x, rows, programs=per_sm * sms, block=block)
            t = timer(fn)
            best = t if best is None else min(best, t)
    return best
