"""What the L2 flush before a timed call leaves the call to pay. Each case runs twice back to
back after the flush, on two independent sets of data (weights, tokens and offsets; caches,
queries and lists), under each flush of zeroinfer.testing.bench.l2_flush - `memset` (a 256 MiB
memset: the L2 full of dirty lines), `read` (a 256 MiB sum: full of clean ones) - and under both in
turn (the reference: certainly evicted, then clean). Both calls find their data cold; the first
inherits the flush's L2 state, the second the first call's. An eviction check comes first: a sum
over a buffer that fits the L2, whose second read hits it.

Measured on the H100 (moe_gemm_NOTES.md, session 24): after the memset, an MXFP4 GEMM reading 53
MB of weights took 32.6 us, after the read 26.4, after both 26.5; every case read 1st = both 1st
within noise. The memset's dirty lines cost the call their write-back (what session 23 had read
as cold instructions: the same kernel binary showed it for one weight shape and not another).

  python3 bench/probe_flush.py [gate_up:1:uniform,down:128:uniform,mla:64:128:fp8,...] [bf16]
An MoE case is gemm (gate_up / gate_up_plain / down) : tokens : routing (uniform / skewed), as
bench/ab_moe_cases.py, W4A8 unless `bf16` is given; an attention case is mla : heads : requests :
cache (fp8 / bf16) [: query tokens a request], V4-Flash decode as bench/bench_sparse_mla.py.
Prints two tables (kernel us from the CUPTI records, medians): the eviction check, then the cases.
"""

import statistics
import sys

import torch

sys.path.insert(0, "bench")
from ab_moe_cases import make_case  # noqa: E402

from zeroinfer.testing import bench  # noqa: E402

DEFAULT = ("gate_up:1:uniform,gate_up_plain:1:uniform,down:1:uniform,gate_up:32:uniform,"
           "down:32:uniform,gate_up:512:skewed,down:512:skewed,"
           "mla:64:1:fp8,mla:64:128:fp8,mla:16:128:fp8,mla:64:128:bf16")
MODES = ("memset", "read")


def moe_calls(case, act, gen, dgen):
    """Two launches of an MoE case on independent weights, tokens and offsets (one routing)."""
    first, offsets = make_case(case, act, gen, dgen)
    second, _ = make_case(case, act, gen, dgen, offsets=offsets.clone())
    return [first, second]


def mla_calls(case, dgen):
    """Two calls of a sparse MLA decode case on independent caches, queries and lists."""
    from bench_sparse_mla import make_inputs

    from zeroinfer.ops import sparse_mla_attention

    parts = case.split(":")
    heads, requests, fmt = int(parts[1]), int(parts[2]), parts[3]
    s_q = int(parts[4]) if len(parts) > 4 else 1
    calls = []
    for _ in range(2):
        kw, _ = make_inputs(requests * s_q, heads, fmt, "cuda", dgen, s_q=s_q)
        calls.append(lambda kw=kw: sparse_mla_attention(**kw))
    return calls


def first_second(calls, flush, reps=20):
    """Median kernel us of the first and the second call after `flush`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        flush()
        torch.cuda.synchronize()
    flush_names = [name for name, _, _ in bench.device_records(prof)]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush()
            calls[0]()
            calls[1]()
        torch.cuda.synchronize()
    first, second = [], []
    for chunk in bench.call_records(bench.device_records(prof), reps, flush_names):
        half = len(chunk) // 2  # records of one call
        if 2 * half != len(chunk):
            raise RuntimeError(f"{len(chunk)} device records for the two calls after a flush")
        first.append(bench.busy_us(chunk[:half]))
        end = max(s + d for _, s, d in chunk[:half])
        second.append(bench.busy_us(chunk[half:], end))  # (it may start under the first's tail)
    return statistics.median(first), statistics.median(second)


def eviction_check(flushes) -> None:
    """Does each flush evict? A sum over a buffer that fits the L2, twice after the flush: the
    second read hits the L2 (what a flush that evicted nothing would leave); the first should
    take as long as HBM makes it."""
    print(f"{'sum over MB (fits L2)':24}" + "".join(f" {m + ' 1st':>11} {m + ' 2nd':>11}"
                                                  for m in flushes))
    for mb in (8, 16, 32):
        x = torch.randn(mb << 18, device="cuda")
        cols = [first_second([x.sum, x.sum], f) for f in flushes.values()]
        print(f"{mb:24}" + "".join(f" {a:11.1f} {b:11.1f}" for a, b in cols), flush=True)


def main() -> None:
    cases = (sys.argv[1] if len(sys.argv) > 1 and ":" in sys.argv[1] else DEFAULT).split(",")
    act = torch.bfloat16 if "bf16" in sys.argv[1:] else torch.float8_e4m3fn
    gen = torch.Generator().manual_seed(0)
    dgen = torch.Generator(device="cuda").manual_seed(1)
    flushes = {m: bench.l2_flush(m) for m in MODES}
    # The memset evicts for certain (its writes allocate in the L2); the read after it leaves
    # clean lines: the reference for what `read` alone should give.
    flushes["memset+read"] = lambda: (flushes["memset"](), flushes["read"]())
    eviction_check(flushes)
    print(f"{'case':24}" + "".join(f" {m + ' 1st':>11} {m + ' 2nd':>11}" for m in flushes))
    for case in cases:
        calls = mla_calls(case, dgen) if case.startswith("mla:") else moe_calls(case, act, gen,
                                                                                dgen)
        for c in calls:
            c()
        torch.cuda.synchronize()
        cols = [first_second(calls, f) for f in flushes.values()]
        print(f"{case:24}" + "".join(f" {a:11.1f} {b:11.1f}" for a, b in cols), flush=True)
        del calls
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
