"""What a cold instruction fetch costs an MXFP4 grouped-GEMM launch: after the L2 flush, the same
case runs twice back to back on two independent sets of weights, tokens and offsets. The first
launch finds everything cold (code included: the flush evicts the kernel's instructions, which
every first-run code region then fetches from HBM); the second finds its data as cold but the
code already in the L2 and the SMs' instruction caches - as a model's next layer would if the
code survived in between. The difference bounds what a warm-up of the code could win (the
float8 wide tile's epilogue warm-up, moe_gemm_NOTES.md sessions 22-23).

The same for sparse MLA attention (independent caches, queries and index lists).

  python3 bench/probe_cold_code.py [gate_up:1:uniform,down:128:uniform,mla:64:128:fp8,...] [bf16]
An MoE case is gemm (gate_up / down) : tokens : routing (uniform / skewed), as
bench/ab_moe_cases.py, W4A8 unless `bf16` is given; an attention case is mla : heads : requests :
cache (fp8 / bf16) [: query tokens a request], V4-Flash decode as bench/bench_sparse_mla.py.
Prints a table (kernel us from the CUPTI records, medians).
"""

import statistics
import sys

import torch

sys.path.insert(0, "bench")
from ab_moe_cases import make_case  # noqa: E402

from zeroinfer.testing import bench  # noqa: E402

DEFAULT = ("gate_up:1:uniform,down:1:uniform,gate_up:32:uniform,down:32:uniform,"
           "gate_up:512:skewed,down:512:skewed,gate_up:2048:skewed,"
           "mla:64:1:fp8,mla:64:128:fp8,mla:16:128:fp8")


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


def main() -> None:
    from torch.profiler import ProfilerActivity, profile

    cases = (sys.argv[1] if len(sys.argv) > 1 and ":" in sys.argv[1] else DEFAULT).split(",")
    act = torch.bfloat16 if "bf16" in sys.argv[1:] else torch.float8_e4m3fn
    gen = torch.Generator().manual_seed(0)
    dgen = torch.Generator(device="cuda").manual_seed(1)
    flush = bench._l2_flush_buffer()
    reps = 20
    print(f"{'case':24} {'cold us':>9} {'warm code':>10} {'difference':>11}")
    for case in cases:
        calls = mla_calls(case, dgen) if case.startswith("mla:") else moe_calls(case, act, gen,
                                                                                dgen)
        for c in calls:
            c()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                flush.zero_()
                calls[0]()
                calls[1]()
            torch.cuda.synchronize()
        ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
        per = len(ev) // reps
        if per * reps != len(ev) or per % 2 != 1:
            raise RuntimeError(f"{len(ev)} device records for {reps} x (flush + 2 calls)")
        half = (per - 1) // 2  # records of one call after the flush's
        cold, warm = [], []
        for i in range(reps):
            chunk = ev[i * per:(i + 1) * per]
            cold.append(sum(e.time_range.elapsed_us() for e in chunk[1:1 + half]))
            warm.append(sum(e.time_range.elapsed_us() for e in chunk[1 + half:]))
        c, wm = statistics.median(cold), statistics.median(warm)
        print(f"{case:24} {c:9.1f} {wm:10.1f} {c - wm:8.1f} us", flush=True)
        del calls
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
