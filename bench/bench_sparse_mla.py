"""Benchmark sparse_mla_attention against the best plain-torch path on the same inputs.

  python bench/bench_sparse_mla.py                 # CPU: C++ twin vs torch float32 einsum path
  python bench/bench_sparse_mla.py --device cuda   # the Hopper kernel, measured ceilings/roofline

V4-Flash attention shapes: 64 query heads (16 = a TP4 shard, 128 = V4-Pro) over one shared
512-dim K=V head; each query token sees a 128-slot sliding window (main cache) plus 512
compressed entries picked by the indexer (extra cache). Decode: `s_q` query tokens per request
(2 = one MTP draft token being verified); the tokens of a request see windows shifted by one and
the same compressed picks. Prefill: consecutive tokens of ONE request.

Counted per case: FLOPs = 4 * T * H * K * 512 (QK^T and PV over every listed key of every query
token); bytes = every DISTINCT cache row the batch touches, once (584 B/token FP8, 1024 B bf16),
+ q + out + lse + indices: the least any kernel must move (FlashMLA counts the same way). The
floor is max(bytes / measured copy bandwidth, FLOPs / measured bf16 matmul rate).
"""

from __future__ import annotations

import os

import torch

from zeroinfer import _C
from zeroinfer.ops.sparse_mla import _sparse_mla_torch, sparse_mla_attention
from zeroinfer.quant.kv_fp8 import quantize_kv_fp8
from zeroinfer.reference.sparse_mla import sparse_mla_attention_ref
from zeroinfer.testing import bench

D = 512
WINDOW, TOPK = 128, 512           # V4-Flash: SWA window + compressed top-k
MAIN_BLOCK, EXTRA_BLOCK = 64, 64  # tokens per cache block (C4A compressed pages hold 64)
EXTRA_PER_REQ = 2048              # compressed entries per request (an 8K context / 4)


def make_inputs(T, H, fmt, dev, gen, *, prefill=False, s_q=1):
    """Decode: T = requests * s_q query tokens; request r owns a private window region of the
    main cache and EXTRA_PER_REQ entries of the extra cache; its j-th token sees the WINDOW slots
    ending one later than its (j-1)-th and the same TOPK sorted random entries. Prefill: T
    consecutive tokens of ONE request: token t sees the window ending at its own slot and TOPK
    random entries of the shared compressed pool (T / 4 entries, at least EXTRA_PER_REQ).
    Returns (op kwargs, distinct cache rows touched)."""
    requests = 1 if prefill else T // s_q
    pool = max(EXTRA_PER_REQ, T // 4) if prefill else EXTRA_PER_REQ
    main_slots = T + WINDOW if prefill else requests * 2 * WINDOW
    extra_slots = requests * pool
    rnd = dict(generator=gen, device=dev)
    main = torch.randn(main_slots // MAIN_BLOCK + 1, MAIN_BLOCK, D, **rnd)
    extra = torch.randn(extra_slots // EXTRA_BLOCK + 1, EXTRA_BLOCK, D, **rnd)
    if fmt == "fp8":
        main, extra = quantize_kv_fp8(main), quantize_kv_fp8(extra)
    else:
        main, extra = main.bfloat16(), extra.bfloat16()
    t = torch.arange(T, device=dev)[:, None]
    window = torch.arange(WINDOW, device=dev)
    if prefill:
        idx = t + 1 + window
        pick = torch.rand(T, pool, **rnd).topk(TOPK, dim=1).indices.sort(dim=1).values
        extra_idx = pick
    else:
        r, j = t // s_q, t % s_q
        idx = r * 2 * WINDOW + WINDOW // 2 + j + window
        pick = torch.rand(requests, pool, **rnd).topk(TOPK, dim=1).indices.sort(dim=1).values
        extra_idx = r * pool + pick.repeat_interleave(s_q, dim=0)
    distinct = idx.unique().numel() + extra_idx.unique().numel()
    return dict(q=torch.randn(T, H, D, **rnd).bfloat16(), kv_cache=main,
                indices=idx.to(torch.int32), softmax_scale=D**-0.5,
                attn_sink=torch.randn(H, **rnd), extra_kv_cache=extra,
                extra_indices=extra_idx.to(torch.int32)), distinct


def bytes_and_flops(T, H, K, fmt, distinct=None):
    per_token = 584 if fmt == "fp8" else 2 * D
    rows = T * K if distinct is None else distinct
    nbytes = rows * per_token + 2 * T * H * D * 2 + T * H * 4 + T * K * 4
    return nbytes, 4 * T * H * K * D


def time_torch_cpu(fn, **kw) -> tuple[float, int]:
    """Best median over torch intra-op thread counts {1, default}: on a small shared machine
    torch's own threads can cost more than they bring, and the baseline should be its best."""
    n0 = torch.get_num_threads()
    best = None
    try:
        for n in sorted({1, n0}):
            torch.set_num_threads(n)
            t = bench.time_cpu(fn, **kw)
            if best is None or t < best[0]:
                best = (t, n)
    finally:
        torch.set_num_threads(n0)
    return best


def cuda_cases():
    """(requests or prefill tokens, heads, cache, prefill, s_q) of the issue's H200 table."""
    cases = [(b, 64, "fp8", False, s_q) for s_q in (1, 2) for b in (1, 8, 32, 64, 128, 256)]
    cases += [(128, 128, "fp8", False, s_q) for s_q in (1, 2)]  # V4-Pro head count
    cases += [(128, 16, "fp8", False, s_q) for s_q in (1, 2)]   # a TP4 shard of V4-Flash
    cases += [(256, 16, "fp8", False, 1), (4096, 16, "fp8", True, 1)]  # its bigger grids
    cases += [(128, 64, "bf16", False, 1)]                      # the bf16 cache, for reference
    cases += [(T, 64, fmt, True, 1) for T in (4096, 32768) for fmt in ("fp8", "bf16")]
    return cases


def check_against_torch(a, out, lse, max_tokens=64):
    """A fast wrong kernel must not post a number: the first tokens against the float32 torch
    path (and, for a few tokens, the float64 reference)."""
    n = min(max_tokens, a["q"].shape[0])
    sub = dict(a, q=a["q"][:n].contiguous(), indices=a["indices"][:n].contiguous(),
               extra_indices=a["extra_indices"][:n].contiguous())
    ref_out = torch.empty_like(out[:n])
    ref_lse = torch.empty_like(lse[:n])
    _sparse_mla_torch(**sub, out=ref_out, lse=ref_lse)
    torch.testing.assert_close(out[:n].float(), ref_out.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse[:n], ref_lse, rtol=1e-4, atol=1e-4)
    if n <= 8:
        cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in sub.items()}
        r_out, r_lse = sparse_mla_attention_ref(**cpu)
        torch.testing.assert_close(out[:n].cpu().double(), r_out, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(lse[:n].cpu().double(), r_lse, rtol=1e-4, atol=1e-4)


def main() -> None:
    args = bench.parse_args(__doc__)
    dev = args.device
    cuda = dev == "cuda"
    if cuda:
        cases = cuda_cases()
        ceilings = bench.measure_cuda_ceilings()
        timer = bench.time_cuda_graph  # device time (eager Python overhead reported apart)
    else:
        cases = [(T, H, fmt, False, 1) for fmt in ("fp8", "bf16") for H in (64, 16)
                 for T in (1, 8, 32)]
        cases.append((256, 16, "fp8", True, 1))  # a small prefill chunk
        ceilings = None
        timer = bench.time_cpu
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for n_req, H, fmt, prefill, s_q in cases:
        T = n_req if prefill else n_req * s_q
        a, distinct = make_inputs(T, H, fmt, dev, gen, prefill=prefill, s_q=s_q)
        K = WINDOW + TOPK
        out, lse = sparse_mla_attention(**a)
        check_against_torch(a, out, lse)
        reps = 10 if T * H <= 2048 else 3
        kw = dict(reps=reps, warmup=1) if not cuda else {}
        call = lambda: sparse_mla_attention(**a, out=out, lse=lse)  # noqa: E731
        t_ours = timer(call, **kw)
        t_eager = t_kern = None
        if cuda:
            t_eager = bench.time_cuda(call)
            t_kern = bench.time_kernels(call)
        t_torch, torch_threads = None, 0
        if T * H * K <= 256 * 64 * 640:  # the torch path gathers [T, K, 512] float32 keys
            ref_out, ref_lse = torch.empty_like(out), torch.empty_like(lse)
            torch_fn = lambda: _sparse_mla_torch(**a, out=ref_out, lse=ref_lse)  # noqa: E731
            if cuda:
                t_torch = bench.time_cuda(torch_fn)
            else:
                t_torch, torch_threads = time_torch_cpu(torch_fn, **kw)
        nbytes, flops = bytes_and_flops(T, H, K, fmt, distinct if cuda else None)
        row = {"mode": "prefill" if prefill else "decode", "batch": 1 if prefill else n_req,
               "s_q": s_q, "tokens": T, "heads": H, "keys": K, "cache": fmt, "window": WINDOW,
               "topk": TOPK, "distinct_rows": distinct,
               **bench.roofline_row(seconds=t_ours, bytes_moved=nbytes, flops=flops,
                                    ceilings=ceilings, kernel_seconds=t_kern),
               "eager_call_us": None if t_eager is None else t_eager * 1e6,
               "torch_us": None if t_torch is None else t_torch * 1e6,
               "speedup_vs_torch": None if t_torch is None else t_torch / t_ours}
        if cuda:
            t_mem = nbytes / ceilings["hbm_bytes_per_s"]
            t_mma = flops / ceilings["bf16_flops_per_s"]
            row["bound"] = "memory" if t_mem >= t_mma else "compute"
            splits, _, _, h16 = _C.sparse_mla_cuda_plan(
                T, H, K, torch.cuda.get_device_properties(0).multi_processor_count,
                fp8=fmt == "fp8")
            row["plan_splits"] = splits
            row["kernel"] = f"fp8_h16_e{h16}" if h16 else f"{fmt}_tile"
        else:
            row["torch_threads"] = torch_threads
        row["gflops"] = row["tflops"] * 1e3
        rows.append(row)
    cols = ["mode", "batch", "s_q", "heads", "cache", "time_us"]
    cols += (["floor_us", "fraction_of_floor", "kernel_us", "kernel_fraction_of_floor", "bound",
              "gbps", "tflops"] if cuda else ["gbps", "gflops"])
    cols += (["eager_call_us"] if cuda else []) + ["torch_us", "speedup_vs_torch"]
    cols += [] if cuda else ["torch_threads"]
    bench.print_table(rows, cols)
    family = "sparse_mla" if cuda else "sparse_mla_cpu"
    baseline = ("_sparse_mla_torch: gather + dequant, float32 einsum, softmax with sink (the "
                "float32 torch path); skipped where its gathered keys would not fit")
    bytes_note = ("distinct cache rows touched + q + out + lse + indices" if cuda else
                  "rows gathered per query token + q + out + lse + indices")
    path = bench.write_results(family, rows, device=dev,
                               extra={"ceilings": ceilings, "torch_baseline": baseline,
                                      "bytes_counted": bytes_note,
                                      "timing": "time_us: CUDA-graph replay of the op (device "
                                      "time, events around the replay), L2 flushed before "
                                      "each call; kernel_us: the op's own device work (CUPTI "
                                      "kernel durations, bench.time_kernels), "
                                      "kernel_fraction_of_floor on it; eager_call_us: the "
                                      "same op called from Python (host overhead included); "
                                      "torch_us: the torch path called eagerly" if cuda else
                                      "median wall time",
                                      "threads": _C.num_threads(),
                                      # other work on a shared machine skews CPU numbers
                                      "load_average_1_5_15": list(os.getloadavg())},
                               out_dir=args.out_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
