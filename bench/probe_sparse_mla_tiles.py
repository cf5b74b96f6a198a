"""How much of a sparse MLA call is per-tile work and how much is each CTA's fixed cost (the Q
load, the index -> slot -> row chain before the first tile, the epilogue, the launch): the V4-Flash
decode inputs of bench_sparse_mla.py (64 heads, FP8 or bf16 cache, 128 window + 512 compressed
entries), with every index list cut to L entries, timed on the H200 (L2 flushed) for L = 64 .. 640
at a few batch sizes. A least-squares line through the points of one batch and one split plan
gives time = fixed + tiles * per_tile. Prints a table; writes nothing (an exploration aid for
bench/results/h200/sparse_mla_NOTES.md, not a benchmark of record).

  python3 bench/probe_sparse_mla_tiles.py [fp8|bf16] [hHEADS] [--no-overheads] [batch ...]
  (default fp8, h64, 64 128 256)
ZEROINFER_MLA_KERNEL is honoured where the build has more than one FP8 kernel.
"""

import sys

import torch

sys.path.insert(0, "bench")
from bench_sparse_mla import WINDOW, make_inputs  # noqa: E402

from zeroinfer import _C  # noqa: E402
from zeroinfer.ops import sparse_mla_attention  # noqa: E402
from zeroinfer.testing import bench  # noqa: E402

LENGTHS = (64, 128, 192, 256, 384, 512, 640)
DEFAULT_HEADS = 64


def cut(kw: dict, length: int) -> dict:
    """The same call with each token's list cut to its first `length` entries (window first)."""
    out = dict(kw)
    out["indices"] = kw["indices"][:, :min(length, WINDOW)].contiguous()
    extra = length - WINDOW
    if extra > 0:
        out["extra_indices"] = kw["extra_indices"][:, :extra].contiguous()
    else:
        out.pop("extra_indices")
        out.pop("extra_kv_cache")
    return out


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares time = a + b * tiles over (tiles, time) points."""
    x = torch.tensor([p[0] for p in points], dtype=torch.float64)
    y = torch.tensor([p[1] for p in points], dtype=torch.float64)
    design = torch.stack([torch.ones_like(x), x], dim=1)
    a, b = torch.linalg.lstsq(design, y[:, None]).solution[:, 0].tolist()
    return a, b


def overheads(fmt: str, heads: int, gen: torch.Generator) -> None:
    """What the timing itself contains: a one-element op replayed as a graph (launch + events),
    and the b = 128 call with the L2 left warm, flushed by a memset (the benchmarks' way up to
    session 24, which leaves the L2 full of dirty lines), or by a read (clean lines; theirs
    since)."""
    tiny = torch.zeros(1, device="cuda")
    print(f"null graph (L2 flushed): {bench.time_cuda_graph(lambda: tiny.add_(1)) * 1e6:.2f} us")
    kw, _ = make_inputs(128, heads, fmt, "cuda", gen)
    out, lse = sparse_mla_attention(**kw)
    fn = lambda: sparse_mla_attention(**kw, out=out, lse=lse)  # noqa: E731
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    warm = bench.time_cuda(g.replay, flush_l2=False)
    read = bench.time_cuda(g.replay)  # (the benchmarks' flush since session 24)
    memset = bench.l2_flush("memset")
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(30)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(30)]
    for s, e in zip(starts, ends):
        memset()
        s.record()
        g.replay()
        e.record()
    torch.cuda.synchronize()
    after_memset = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))[15] * 1e3
    print(f"b 128: L2 warm {warm * 1e6:.1f} us, memset flush {after_memset:.1f} us, "
          f"read flush {read * 1e6:.1f} us")


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("probe_sparse_mla_tiles.py needs a CUDA GPU")
    args = sys.argv[1:]
    fmt = "bf16" if "bf16" in args else "fp8"
    heads = next((int(a[1:]) for a in args if a.startswith("h")), DEFAULT_HEADS)
    skip_overheads = "--no-overheads" in args
    batches = [int(a) for a in args if a.isdigit()] or [64, 128, 256]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    if not skip_overheads:
        overheads(fmt, heads, gen)
    print(f"{fmt} cache, {heads} heads, s_q 1; time_us with L2 flushed")
    print(f"{'batch':>5} {'L':>4} {'tiles':>5} {'splits':>6} {'time_us':>8}")
    for batch in batches:
        kw, _ = make_inputs(batch, heads, fmt, "cuda", gen)
        by_plan: dict[int, list[tuple[int, float]]] = {}
        for length in LENGTHS:
            call = cut(kw, length)
            splits, tiles_per_cta, _, _ = _C.sparse_mla_cuda_plan(batch, heads, length, sms,
                                                                   fp8=fmt == "fp8")
            out, lse = sparse_mla_attention(**call)
            t = bench.time_cuda_graph(
                lambda: sparse_mla_attention(**call, out=out, lse=lse)) * 1e6  # noqa: B023
            tiles = -(-length // 64)
            by_plan.setdefault(splits, []).append((tiles_per_cta, t))
            print(f"{batch:5d} {length:4d} {tiles:5d} {splits:6d} {t:8.2f}")
        for splits, points in sorted(by_plan.items()):
            if len(points) >= 2:
                a, b = fit(points)
                print(f"  batch {batch}, {splits} split(s): time = {a:.1f} us fixed + {b:.2f} us "
                      f"a tile of a CTA ({len(points)} points)")


if __name__ == "__main__":
    main()
