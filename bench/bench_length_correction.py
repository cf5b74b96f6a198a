"""Benchmark correct_lengths (the zero-overhead scheduler's device-side fix-up) against a
vectorised plain-torch version of the same arithmetic.

  python bench/bench_length_correction.py                 # CPU twin vs torch (CPU)
  python bench/bench_length_correction.py --device cuda   # CUDA kernel vs torch (CUDA)

The op moves a few KB, so it is bound by launch latency on a GPU: what matters is that it is one
launch of a few microseconds with no host synchronisation. Each case is timed three ways on CUDA,
as the other op benchmarks are: `time_us`, the eager Python call (argument checks, output
allocation, launch; L2 flushed before each call - when the host takes longer than the flush this
is host time); `graph_us`, the call with preallocated outputs captured in a CUDA graph and
replayed (what the scheduler's captured step pays); `kernel_us`, the kernel's own device time
(CUPTI). `bytes` is the fewest the op must move (op_bytes); the fraction is bytes / measured copy
bandwidth over the time, far below 1 by nature (the floor is the launch, not the bytes).
"""

from __future__ import annotations


import torch

from zeroinfer.ops import CorrectedLengths, correct_lengths
from zeroinfer.testing import bench


def torch_correct(remap, acc, nxt, nnext, assumed, cu, k, pos, ids):
    R, n = remap.numel(), pos.numel()
    q_opt = cu[1:] - cu[:-1]
    row = torch.repeat_interleave(torch.arange(R, device=pos.device), q_opt, output_size=n)
    j = torch.arange(n, device=pos.device) - cu[:-1][row]
    matched = remap >= 0
    p = remap.clamp(min=0).long()
    delta = torch.where(matched, acc[p] - assumed, 0)
    q = torch.where(matched, torch.minimum(q_opt, nnext[p]), q_opt)
    k_out = k + delta - (q_opt - q)
    valid = j < q[row]
    m = matched[row]
    pos_out = torch.where(m, torch.where(valid, pos + delta[row], -1), pos)
    nxt_tok = nxt[p[row], j.clamp(max=nxt.shape[1] - 1)]
    ids_out = torch.where(m, torch.where(valid, nxt_tok, 0), ids)
    return q, k_out, pos_out, ids_out


def op_bytes(R, n):
    """Read remap, assumed_accepted, seqlens_k, the R gathered prev_num_accepted / prev_num_next,
    cu_seqlens_q (R + 1), positions, input_ids and the n gathered next tokens; write seqlens_q,
    seqlens_k, positions and input_ids. All int32."""
    return 4 * ((5 * R + R + 1 + 3 * n) + (2 * R + 2 * n))


def make_round(R, S, device, gen):
    ri = lambda lo, hi, *s: torch.randint(lo, hi, s, generator=gen, dtype=torch.int32)  # noqa: E731
    remap = torch.randperm(R, generator=gen).to(torch.int32)
    remap[torch.rand(R, generator=gen) < 0.1] = -1
    q_opt = torch.full((R,), S, dtype=torch.int32)
    cu = torch.zeros(R + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(q_opt, 0)
    n = int(cu[-1])
    args = (remap, ri(1, S + 1, R), ri(0, 129280, R, S), torch.full((R,), S, dtype=torch.int32),
            torch.full((R,), S, dtype=torch.int32), cu, ri(S, 8000, R), ri(0, 8000, n),
            ri(0, 129280, n))
    return tuple(a.to(device) for a in args)


def main() -> None:
    args = bench.parse_args(__doc__)
    dev = args.device
    cuda = dev == "cuda"
    ceilings = bench.measure_cuda_ceilings() if cuda else None
    gen = torch.Generator().manual_seed(0)
    rows = []
    for R in (1, 8, 64, 256, 1024, 4096):
        for S in (1, 4):
            a = make_round(R, S, dev, gen)
            # A fast wrong kernel must not post a number: both paths agree exactly first.
            ours, theirs = correct_lengths(*a), torch_correct(*a)
            assert all(torch.equal(x, y.to(torch.int32)) for x, y in zip(ours, theirs)), (R, S)
            out = CorrectedLengths(*(torch.empty_like(t) for t in ours))
            rows.append({"rows": R, "tokens_per_row": S, **bench.small_op_row(
                lambda: correct_lengths(*a), lambda: correct_lengths(*a, out=out),
                lambda: torch_correct(*a), bytes_moved=op_bytes(R, R * S), ceilings=ceilings,
                cuda=cuda)})
    bench.report_small_ops("length_correction", rows, ["rows", "tokens_per_row"],
                           args=args, ceilings=ceilings)


if __name__ == "__main__":
    main()
