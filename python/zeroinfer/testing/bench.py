"""The one benchmark harness: timing, ceilings, the printed table and the JSON result file.

Every bench/bench_<family>.py uses it, so all results carry the same fields:
commit, machine, shapes, median time, bytes/FLOPs, achieved GB/s and TFLOP/s, and the fraction
of the roofline floor max(bytes / bandwidth, flops / peak) with the ceilings MEASURED in the same
run (never datasheet numbers).
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]


def parse_args(description: str | None = None):
    """The common command line of bench/bench_<family>.py: --device cpu|cuda and --out-dir
    (results root, default bench/results; args.out_dir is a Path or None)."""
    import argparse

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out-dir", default=None, type=Path, help="results root (default bench/results)")
    return ap.parse_args()


def git_commit() -> str:
    """HEAD (with -dirty for uncommitted changes), or $ZEROINFER_COMMIT where the tree has no
    .git (the H200 receives a plain copy of the working tree)."""
    import os

    if os.environ.get("ZEROINFER_COMMIT"):
        return os.environ["ZEROINFER_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.strip()
        # (changed result files do not count: a sweep's earlier benchmarks rewrite them)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                ".", ":(exclude)bench/results"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
        return out + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine_name(device: str = "cpu") -> str:
    """Folder name under bench/results/: 'h200' for an H200, else e.g. 'cpu-2core'."""
    if device == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name().lower()
        return "h200" if "h200" in name else name.replace("nvidia ", "").replace(" ", "-")
    import os

    return f"cpu-{os.cpu_count()}core"


def time_cpu(fn: Callable[[], object], *, warmup: int = 2, reps: int = 10) -> float:
    """Median wall time in seconds of fn() on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


_L2_FLUSH: torch.Tensor | None = None


def _l2_flush_buffer() -> torch.Tensor:
    """The 256 MiB buffer (well over the H200's 60 MB L2) the L2 flush goes through."""
    global _L2_FLUSH
    if _L2_FLUSH is None:
        _L2_FLUSH = torch.zeros(64 << 20, dtype=torch.float32, device="cuda")
    return _L2_FLUSH


def l2_flush(mode: str = "read") -> Callable[[], object]:
    """The L2 flush before every timed call: by default a read of the 256 MiB buffer (a sum),
    which leaves the L2 holding only clean lines of that buffer, so the timed call finds none of
    its data there and owes nothing to what ran before.

    Not a memset (mode "memset", what the benchmarks used up to session 24): a memset leaves the
    L2 full of dirty lines, and the first call that reads more than about the L2's size then pays
    for writing them back - HBM traffic that belongs to the flush. Measured on the H100
    (bench/probe_flush.py): an MXFP4 GEMM reading 53 MB of weights took 32.6 us right after a
    memset, 26.4 us after the read, 26.5 us after a memset followed by the read (which certainly
    evicts, and cleans); sparse MLA's bf16 64-head b = 128 call 47.7 / 38.8 / 39.3 us
    (moe_gemm_NOTES.md, session 24)."""
    if mode not in ("read", "memset"):
        raise ValueError(f"l2_flush: mode must be 'read' or 'memset', got {mode!r}")
    buf = _l2_flush_buffer()
    return buf.sum if mode == "read" else buf.zero_


def _warm_up(fn: Callable[[], object], calls: int) -> None:
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()


def time_cuda(fn: Callable[[], object], *, warmup: int = 5, reps: int = 50,
              flush_l2: bool = True) -> float:
    """Median time in seconds of fn() on the current CUDA stream, by CUDA events, with the L2
    flushed (l2_flush: a read of 256 MiB, well over the H200's 60 MB L2) before every timed
    call."""
    flush = l2_flush() if flush_l2 else None
    _warm_up(fn, warmup)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        if flush is not None:
            flush()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) / 1e3


def time_cuda_graph(fn: Callable[[], object], **kw) -> float:
    """time_cuda of fn() captured once in a CUDA graph and replayed: the device time of the
    launch sequence without Python's per-call overhead (which, for calls of tens of µs, would
    otherwise show up as idle time between the events). fn must be graph-capturable (no host
    sync) and write into preallocated outputs."""
    _warm_up(fn, 1)  # outside the capture (one-time allocations, kernel attribute set-up)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_cuda(graph.replay, **kw)


def time_kernels(fn: Callable[[], object], *, warmup: int = 3, reps: int = 30,
                 flush_l2: bool = True) -> float:
    """Median time in seconds of the device work fn() launches (kernels, memsets, copies), from
    the CUPTI activity records (torch.profiler): the time they keep the device busy
    (call_busy_us), with the L2 flushed before every call like time_cuda; the flush itself is not
    counted.

    time_cuda_graph's events also hold the graph launch and the event records, ~3-4 us that a
    decode step, one graph of hundreds of kernels, does not pay per kernel (measured on the H200:
    a one-element op replays in 4.1 us event to event). For ops of 10-50 us that bounds the
    fraction of the roofline well below 1 whatever the kernel does, so the benchmarks report
    both: time_us (events, conservative) and kernel_us (this: what the op occupies the device
    for; DeepGEMM's bench_kineto measures the same way)."""
    from torch.profiler import ProfilerActivity, profile

    flush = l2_flush() if flush_l2 else None
    _warm_up(fn, warmup)

    flush_names: list[str] = []
    if flush is not None:  # what the flush shows up as (its kernels, in order)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            flush()
            torch.cuda.synchronize()
        flush_names = [name for name, _, _ in device_records(prof)]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            if flush is not None:
                flush()
            fn()
        torch.cuda.synchronize()
    return statistics.median(call_busy_us(device_records(prof), reps, flush_names)) / 1e6


def device_records(prof) -> list[tuple[str, float, float]]:
    """The device records (name, start, duration us) of a torch.profiler run, in start order."""
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(((e.name, e.time_range.start, e.time_range.elapsed_us()) for e in ev),
                  key=lambda r: r[1])


def _call_chunks(records: Sequence[tuple[str, float, float]], calls: int,
                 flush_names: Sequence[str]) -> list[tuple[list, list]]:
    """Per call, (the flush's records, its own records), from records given in start order:
    every call launches the same records, so the calls are consecutive chunks of equal length,
    each opened by the flush's records (flush_names, in order)."""
    per = len(records) // calls if calls > 0 else 0
    if per == 0 or per * calls != len(records):
        raise RuntimeError(f"time_kernels: {len(records)} device records for {calls} calls")
    skip = len(flush_names)
    out = []
    for i in range(calls):
        chunk = list(records[i * per:(i + 1) * per])
        if [name for name, _, _ in chunk[:skip]] != list(flush_names):
            raise RuntimeError("time_kernels: a call's records do not start with the L2 flush")
        out.append((chunk[:skip], chunk[skip:]))
    return out


def call_records(records: Sequence[tuple[str, float, float]], calls: int,
                 flush_names: Sequence[str]) -> list[list[tuple[str, float, float]]]:
    """Per call, its own device records (name, start, duration), the flush's left out
    (_call_chunks)."""
    return [own for _, own in _call_chunks(records, calls, flush_names)]


def busy_us(records: Sequence[tuple[str, float, float]], since: float = float("-inf")) -> float:
    """The time (us) device records (name, start, duration) keep the device busy from `since` on:
    the union of their intervals. A programmatic launch (cudaLaunchAttributeProgrammatic-
    StreamSerialization) may start under the tail of the kernel before it and wait there, so its
    record overlaps that kernel's: summed durations would count the overlap twice. Records that
    do not overlap give their sum."""
    t, busy = since, 0.0
    for _, s, d in sorted(records, key=lambda r: r[1]):
        lo, hi = max(s, t), s + d
        if hi > lo:
            busy += hi - lo
            t = hi
    return busy


def call_busy_us(records: Sequence[tuple[str, float, float]], calls: int,
                 flush_names: Sequence[str]) -> list[float]:
    """Per call, busy_us of its own records from the end of its flush on (a kernel starting
    under the flush's tail waits there: not the op's time)."""
    return [busy_us(own, max((s + d for _, s, d in flush), default=float("-inf")))
            for flush, own in _call_chunks(records, calls, flush_names)]


def measure_cuda_ceilings() -> dict[str, float]:
    """Measured in this run: device-to-device copy bandwidth (bytes read + written per second)
    and dense bf16 matmul rate on random data, the ceilings the roofline fractions use."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    t_copy = time_cuda(lambda: dst.copy_(src), warmup=3, reps=20, flush_l2=False)
    m = 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    t_mm = time_cuda(lambda: a @ b, warmup=3, reps=20, flush_l2=False)
    src = dst = a = b = None  # free the buffers before the benchmark proper
    return {"hbm_bytes_per_s": 2 * n / t_copy, "bf16_flops_per_s": 2 * m**3 / t_mm}


def roofline_row(*, seconds: float, bytes_moved: float, flops: float,
                 ceilings: dict[str, float] | None,
                 kernel_seconds: float | None = None) -> dict[str, float | None]:
    """Achieved rates and, when ceilings are known, the fraction of the floor
    max(bytes / bandwidth, flops / peak) that the measured time reaches; with kernel_seconds
    (time_kernels) also kernel_us and kernel_fraction_of_floor, the same floor over the time the
    op's own device work takes."""
    row: dict[str, float | None] = {
        "time_us": seconds * 1e6,
        "bytes": bytes_moved,
        "flops": flops,
        "gbps": bytes_moved / seconds / 1e9,
        "tflops": flops / seconds / 1e12,
        "floor_us": None,
        "fraction_of_floor": None,
    }
    if ceilings:
        floor = max(bytes_moved / ceilings["hbm_bytes_per_s"],
                    flops / ceilings["bf16_flops_per_s"])
        row["floor_us"] = floor * 1e6
        row["fraction_of_floor"] = floor / seconds
    if kernel_seconds is not None:
        row["kernel_us"] = kernel_seconds * 1e6
        row["kernel_fraction_of_floor"] = (floor / kernel_seconds) if ceilings else None
    return row


def small_op_row(call: Callable[[], object], fill: Callable[[], object],
                 torch_call: Callable[[], object], *, bytes_moved: float,
                 ceilings: dict[str, float] | None, cuda: bool) -> dict[str, float | None]:
    """Timings of a launch-bound op (a few KB to MB): `call` eagerly (time_us and the roofline
    fields), `fill` (the same call into preallocated outputs) as a CUDA-graph replay (graph_us)
    and by its own device work (kernel_us), and `torch_call`, the torch path (torch_us,
    speedup_vs_torch). On CPU: time_cpu, no graph or kernel time."""
    timer = time_cuda if cuda else time_cpu
    t_ours, t_torch = timer(call), timer(torch_call)
    row = roofline_row(seconds=t_ours, bytes_moved=bytes_moved, flops=0, ceilings=ceilings,
                       kernel_seconds=time_kernels(fill) if cuda else None)
    row.update(torch_us=t_torch * 1e6, speedup_vs_torch=t_torch / t_ours)
    if cuda:
        row["graph_us"] = time_cuda_graph(fill) * 1e6
    return row


def small_op_columns(cuda: bool) -> list[str]:
    """print_table columns of small_op_row's fields."""
    gpu = ["graph_us", "kernel_us", "kernel_fraction_of_floor"] if cuda else []
    return ["bytes", "time_us", *gpu, "torch_us", "speedup_vs_torch"]


def report_small_ops(family: str, rows: Sequence[dict[str, object]], keys: Sequence[str], *,
                     args, ceilings: dict[str, float] | None) -> Path:
    """The end of a small-op benchmark: its table (the `keys` columns, then small_op_row's)
    printed, and its JSON written (with the ceilings and the timing note on CUDA)."""
    cuda = args.device == "cuda"
    print_table(rows, [*keys, *small_op_columns(cuda)])
    extra = {"ceilings": ceilings, "timing": SMALL_OP_TIMING} if cuda else None
    path = write_results(family, rows, device=args.device, extra=extra, out_dir=args.out_dir)
    print(f"wrote {path}")
    return path


SMALL_OP_TIMING = ("time_us: the op called eagerly, CUDA events, L2 flushed before each call; "
                   "graph_us: its CUDA-graph replay with preallocated outputs; kernel_us: its own "
                   "device work (CUPTI); torch_us: the torch path called eagerly")


def print_table(rows: Sequence[dict[str, object]], columns: Sequence[str]) -> None:
    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c)
              for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def write_results(family: str, rows: Sequence[dict[str, object]], *, device: str,
                  extra: dict[str, object] | None = None, out_dir: Path | None = None) -> Path:
    """bench/results/<machine>/<family>.json with the commit, machine and every row."""
    machine = machine_name(device)
    folder = (out_dir or REPO / "bench" / "results") / machine
    folder.mkdir(parents=True, exist_ok=True)
    doc = {
        "family": family,
        "commit": git_commit(),
        "machine": machine,
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor()
        or platform.machine(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        # (files before session 24 were timed after a memset flush: see l2_flush)
        **({"l2_flush": "a 256 MiB read before each timed call (bench.l2_flush)"}
           if device == "cuda" else {}),
        **(extra or {}),
        "rows": list(rows),
    }
    path = folder / f"{family}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path
