"""HBM ceilings by access kind on the GPU at hand: copy (read + write, what every benchmark's
roofline uses: zeroinfer.testing.bench.measure_cuda_ceilings), read-only (torch sum; a Triton
streaming read where Triton is installed) and write-only (fill of float32 and of uint8 - the
latter is the memset that was the L2 flush up to session 24). An exploration aid for the notes
under bench/results/h200/; writes nothing.

  python3 bench/probe_hbm_ceilings.py
"""

import sys

import torch

from zeroinfer.testing import bench, stream_read

N = 1 << 30  # bytes per buffer


def seconds(fn) -> float:
    """Every rate below is timed this one way (no flush: the buffers are far larger than L2)."""
    return bench.time_cuda(fn, warmup=3, reps=20, flush_l2=False)


def rate(fn, nbytes: int) -> float:
    return nbytes / seconds(fn) / 1e12


def triton_read(x: torch.Tensor):
    """The best grid of a streaming read of all of x (zeroinfer.testing.stream_read), or None
    without Triton."""
    rows = torch.zeros(1, dtype=torch.int32, device=x.device)
    t = stream_read.best_read_seconds(x.view(1, -1), rows, seconds)
    return None if t is None else x.numel() * x.element_size() / t / 1e12


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
