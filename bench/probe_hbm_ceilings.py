"""HBM ceilings by access kind on the GPU at hand: copy (read + write, what every benchmark's
roofline uses: zeroinfer.testing.bench.measure_cuda_ceilings), read-only (torch sum; a Triton
streaming read where Triton is installed) and write-only (fill of float32 and of uint8 - the
latter is the memset that was the L2 flush up to session 24). An exploration aid for the notes
under bench/results/h200/; writes nothing.

  python3 bench/probe_hbm_ceilings.py
"""

import sys

import torch

from zeroinfer.testing import bench

N = 1 << 30  # bytes per buffer


def rate(fn, nbytes: int) -> float:
    return nbytes / bench.time_cuda(fn, warmup=3, reps=20, flush_l2=False) / 1e12


def triton_read(x: torch.Tensor):
    """A grid-stride streaming read (int32 sums kept per program), or None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def _read(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for i in range(pid, n // BLOCK, tl.num_programs(0)):
            acc += tl.load(x_ptr + i * BLOCK + tl.arange(0, BLOCK), cache_modifier=".cg")
        tl.store(out_ptr + pid * BLOCK + tl.arange(0, BLOCK), acc)

    xi = x.view(torch.int32)
    best = 0.0
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for programs in (4 * sms, 8 * sms, 16 * sms):
        for block in (1024, 2048, 4096):
            out = torch.empty(programs * block, dtype=torch.int32, device="cuda")
            best = max(best, rate(lambda: _read[(programs,)](xi, out, xi.numel(),  # noqa: B023
                                                             BLOCK=block), N))
    return best


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("probe_hbm_ceilings.py needs a CUDA GPU")
    src = torch.empty(N, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    rows = [("copy (read + write bytes)", rate(lambda: dst.copy_(src), 2 * N)),
            ("read: torch float32 sum", rate(lambda: src.view(torch.float32).sum(), N)),
            ("read: Triton streaming (best grid)", triton_read(src)),
            ("write: float32 fill", rate(lambda: dst.view(torch.float32).fill_(1.5), N)),
            ("write: uint8 zero_ (the L2 flush)", rate(lambda: dst.zero_(), N))]
    for name, tbps in rows:
        print(f"{name:38s} {'n/a (no Triton)' if tbps is None else f'{tbps:.3f} TB/s'}")


if __name__ == "__main__":
    main()
