"""Benchmark sparse_mla_attention against the best plain-torch path on the same inputs.

  python bench/bench_sparse_mla.py                 # CPU: C++ twin vs torch float32 einsum path
  python bench/bench_sparse_mla.py --device cuda   # CUDA op (interim torch path until the Hopper
                                                   # kernel) with measured ceilings / roofline

V4-Flash attention shapes: 64 query heads (16 = a TP4 shard) over one shared 512-dim K=V head;
each query token sees a 128-slot sliding window (main cache) plus 512 compressed entries picked
by the indexer (extra cache). Decode: one query token per request (s_q = 1), so no key is
shared between query tokens; prefill: consecutive tokens of one request.

Counted per case: FLOPs = 4 * T * H * K * 512 (QK^T and PV); bytes = the key rows gathered per
query token (584 B/token FP8, 1024 B bf16) + q + out + lse + indices: the least a kernel that
streams every selected row once per token must move.
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


def make_inputs(T, H, fmt, dev, gen, *, prefill=False):
    """Decode: T requests with one query token each; request t owns a private window region of
    the main cache and EXTRA_PER_REQ entries of the extra cache, and sees its last WINDOW slots
    plus TOPK sorted random entries. Prefill: T consecutive tokens of ONE request: token t sees
    the window ending at its own slot and TOPK random entries of the shared compressed pool."""
    requests = 1 if prefill else T
    main_slots = T + WINDOW if prefill else T * 2 * WINDOW
    extra_slots = requests * EXTRA_PER_REQ
    rnd = dict(generator=gen, device=dev)
    main = torch.randn(main_slots // MAIN_BLOCK + 1, MAIN_BLOCK, D, **rnd)
    extra = torch.randn(extra_slots // EXTRA_BLOCK + 1, EXTRA_BLOCK, D, **rnd)
    if fmt == "fp8":
        main, extra = quantize_kv_fp8(main), quantize_kv_fp8(extra)
    else:
        main, extra = main.bfloat16(), extra.bfloat16()
    t = torch.arange(T, device=dev)[:, None]
    window = torch.arange(WINDOW, device=dev)
    idx = t + 1 + window if prefill else t * 2 * WINDOW + WINDOW // 2 + window
    pick = torch.rand(T, EXTRA_PER_REQ, **rnd).topk(TOPK, dim=1).indices.sort(dim=1).values
    extra_idx = pick if prefill else t * EXTRA_PER_REQ + pick
    return dict(q=torch.randn(T, H, D, **rnd).bfloat16(), kv_cache=main,
                indices=idx.to(torch.int32), softmax_scale=D**-0.5,
                attn_sink=torch.randn(H, **rnd), extra_kv_cache=extra,
                extra_indices=extra_idx.to(torch.int32))


def bytes_and_flops(T, H, K, fmt):
    per_token = 584 if fmt == "fp8" else 2 * D
    nbytes = T * K * per_token + 2 * T * H * D * 2 + T * H * 4 + T * K * 4
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


def main() -> None:
    args = bench.parse_args(__doc__)
    dev = args.device
    cuda = dev == "cuda"
    if cuda:
        cases = [(T, 64, "fp8", False) for T in (1, 2, 8, 32, 64, 128, 256)]
        cases += [(T, 128, "fp8", False) for T in (1, 64, 128)]  # V4-Pro head count
        cases += [(2048, 64, "fp8", True)]
        ceilings = bench.measure_cuda_ceilings()
        timer = bench.time_cuda
    else:
        cases = [(T, H, fmt, False) for fmt in ("fp8", "bf16") for H in (64, 16)
                 for T in (1, 8, 32)]
        cases.append((256, 16, "fp8", True))  # a small prefill chunk
        ceilings = None
        timer = bench.time_cpu
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for T, H, fmt, prefill in cases:
        a = make_inputs(T, H, fmt, dev, gen, prefill=prefill)
        K = WINDOW + TOPK
        out, lse = sparse_mla_attention(**a)
        # A fast wrong kernel must not post a number: check against the torch path first.
        ref_out = torch.empty_like(out)
        ref_lse = torch.empty_like(lse)
        _sparse_mla_torch(**a, out=ref_out, lse=ref_lse)
        torch.testing.assert_close(out.float(), ref_out.float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)
        if T <= 8:  # and small cases against the float64 reference (the CUDA op IS the torch
            # path until the Hopper kernel lands)
            cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in a.items()}
            r_out, r_lse = sparse_mla_attention_ref(**cpu)
            torch.testing.assert_close(out.cpu().double(), r_out, rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(lse.cpu().double(), r_lse, rtol=1e-4, atol=1e-4)
        reps = 10 if T * H <= 2048 else 3
        kw = dict(reps=reps, warmup=1) if not cuda else {}
        t_ours = timer(lambda: sparse_mla_attention(**a, out=out, lse=lse), **kw)
        torch_fn = lambda: _sparse_mla_torch(**a, out=ref_out, lse=ref_lse)  # noqa: E731
        if cuda:
            t_torch, torch_threads = timer(torch_fn), 0
        else:
            t_torch, torch_threads = time_torch_cpu(torch_fn, **kw)
        nbytes, flops = bytes_and_flops(T, H, K, fmt)
        row = {"mode": "prefill" if prefill else "decode", "tokens": T, "heads": H, "keys": K,
               "cache": fmt, "window": WINDOW, "topk": TOPK,
               **bench.roofline_row(seconds=t_ours, bytes_moved=nbytes, flops=flops,
                                    ceilings=ceilings),
               "torch_us": t_torch * 1e6, "speedup_vs_torch": t_torch / t_ours}
        if not cuda:
            row["torch_threads"] = torch_threads
        row["gflops"] = row["tflops"] * 1e3
        rows.append(row)
    cols = ["mode", "tokens", "heads", "keys", "cache", "time_us", "gbps", "gflops"]
    cols += ["fraction_of_floor"] if cuda else []
    cols += ["torch_us", "speedup_vs_torch"] + ([] if cuda else ["torch_threads"])
    bench.print_table(rows, cols)
    family = "sparse_mla" if cuda else "sparse_mla_cpu"
    path = bench.write_results(family, rows, device=dev,
                               extra={"ceilings": ceilings,
                                      "torch_baseline": "_sparse_mla_torch: gather + dequant, "
                                      "float32 einsum, softmax with sink (interim CUDA path)",
                                      "threads": _C.num_threads(),
                                      # other work on a shared machine skews CPU numbers
                                      "load_average_1_5_15": list(os.getloadavg())},
                               out_dir=args.out_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
