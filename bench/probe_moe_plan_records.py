"""Per-launch device durations of one MoE GEMM plan, measured alone in a process (the benchmark's
own routing and weights for gate_up at `tokens` tokens uniform; default 128, the four-launch
plan), two rounds each of CUPTI records and a CUDA-graph replay - to tell a kernel's time from
what the full benchmark's process adds around it. Per round: the launches' summed durations, the
busy time (bench.call_busy_us: what kernel_us reports; below the sum where launches overlap),
the span from the first start to the last end, and the graph replay's event time.

  python3 bench/probe_moe_plan_records.py [tokens] [--full] [--heavy] [--pause S]
--full also allocates what bench_moe_gemm.py holds (both GEMMs' raw weights and all four packs,
~10 GB) before timing, to test whether the process's footprint moves the times. --heavy runs the
benchmark's float32 reference check on the same inputs right before each timed pass (as the
benchmark does before its first), --pause S sleeps S seconds after it: the benchmark's rows at
128 tokens read 10-15% slower than this probe in some runs (moe_gemm_NOTES.md, session 25)."""

import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "bench")
from bench_moe_gemm import (CUDA_TOKENS, EXPERTS, HIDDEN, INTER, LIMIT, TorchPath,  # noqa: E402
                            _quant_fp8, make_weights, routing_offsets)

from zeroinfer.ops import mxfp4_grouped_gemm, mxfp4_prepack  # noqa: E402
from zeroinfer.testing import bench  # noqa: E402

ACTS = (torch.bfloat16, torch.float8_e4m3fn)


def main() -> None:
    argv = sys.argv[1:]
    full, heavy = "--full" in argv, "--heavy" in argv
    pause = float(argv[argv.index("--pause") + 1]) if "--pause" in argv else 0.0
    args = [a for i, a in enumerate(argv)
            if not a.startswith("--") and not (i and argv[i - 1] == "--pause")]
    tokens = int(args[0]) if args else 128
    print(f"tokens {tokens} full {full} heavy {heavy} pause {pause}")
    gen = torch.Generator().manual_seed(0)
    dgen = torch.Generator(device="cuda").manual_seed(1)
    w, s = make_weights(EXPERTS, 2 * INTER, HIDDEN, dgen)
    keep = []
    if full:
        keep = [mxfp4_prepack(w, s, fuse_swiglu=True, act_dtype=a) for a in ACTS]
        wd, sd = make_weights(EXPERTS, HIDDEN, INTER, dgen)
        keep += [wd, sd] + [mxfp4_prepack(wd, sd, act_dtype=a) for a in ACTS]
    print("allocated GB", round(torch.cuda.memory_allocated() / 1e9, 2))
    for t in CUDA_TOKENS:  # the same routing draws as the benchmark (skewed draws nothing)
        off = routing_offsets(t, EXPERTS, False, gen)
        if t == tokens:
            break
    print("experts by row count:", torch.bincount(off[1:] - off[:-1]).tolist())
    off_host = off.tolist()
    off = off.cuda()
    check = TorchPath("float32_loop")
    x = torch.randn(int(off[-1]), HIDDEN, generator=dgen, device="cuda") * 0.5
    flush = bench.l2_flush()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        flush()
        torch.cuda.synchronize()
    flush_names = [name for name, _, _ in bench.device_records(prof)]
    for i, act in enumerate(ACTS):
        pw = keep[i] if full else mxfp4_prepack(w, s, fuse_swiglu=True, act_dtype=act)
        a, sc = _quant_fp8(x) if act == torch.float8_e4m3fn else (x.bfloat16(), None)

        def run():
            return mxfp4_grouped_gemm(a, pw, None, a_scale=sc, expert_offsets=off,
                                      fuse_swiglu=True, swiglu_limit=LIMIT)

        def before_pass():
            if heavy:
                check(a, sc, w, s, off_host, True, LIMIT, INTER)
                torch.cuda.synchronize()
            if pause:
                time.sleep(pause)

        for _ in range(3):
            run()
        for rnd in range(2):
            before_pass()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(30):
                    flush()
                    run()
                torch.cuda.synchronize()
            records = bench.device_records(prof)
            calls = bench.call_records(records, 30, flush_names)
            med = [statistics.median(c[j][2] for c in calls) for j in range(len(calls[0]))]
            span = statistics.median(c[-1][1] + c[-1][2] - c[0][1] for c in calls)
            busy = statistics.median(bench.call_busy_us(records, 30, flush_names))
            before_pass()
            graph = bench.time_cuda_graph(run, warmup=3, reps=30) * 1e6
            launches = " | ".join(f"{name.split('<')[0].split('::')[-1]} {d:.1f}"
                                  for (name, _, _), d in zip(calls[0], med))
            print(f"{str(act).split('.')[-1]} round {rnd}: sum {sum(med):.1f} busy {busy:.1f} "
                  f"span {span:.1f} graph {graph:.1f} us :: {launches}")


if __name__ == "__main__":
    main()
