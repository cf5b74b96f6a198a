"""Benchmark mxfp4_grouped_gemm against the best plain-torch path on the same inputs.

  python bench/bench_moe_gemm.py                 # CPU: the C++ twin vs torch (CPU)
  python bench/bench_moe_gemm.py --device cuda   # CUDA path vs torch, roofline (H200)

V4-Flash routed-expert GEMMs, bf16 activations, MXFP4 weights:
  gate_up: [rows, 4096] @ (w1 ‖ w3)[e]ᵀ, N = 2 * 2048, fused clipped SwiGLU (λ = 10) -> [rows, 2048]
  down:    [rows, 2048] @ w2[e]ᵀ, N = 4096 -> [rows, 4096]
Routing: each token picks top-6 of the experts (uniform: random scores; skewed: every token on the
same 6 experts); rows are sorted by expert (contiguous layout, as moe_dispatch produces). The CPU
run uses a subset of 16 experts (weights of all 256 do not fit a small machine); the CUDA run all
256.

The torch baseline dequantizes each active expert to float32 (byte -> value-pair table gather,
times the UE8M0 scales) and multiplies with torch.matmul, SwiGLU in torch; its time includes the
dequantization, as the kernel's does. Bytes are what a kernel must move at least: the packed
weights and scales of the active experts, the activations read and the outputs written.
"""

from __future__ import annotations


import torch

from zeroinfer import _C
from zeroinfer.ops.moe_gemm import mxfp4_grouped_gemm
from zeroinfer.quant.mxfp4 import dequantize_mxfp4
from zeroinfer.testing import bench

HIDDEN, INTER, EXPERTS, TOPK, LIMIT = 4096, 2048, 256, 6, 10.0
CPU_EXPERTS = 16


def torch_grouped(a, w, s, offsets, fuse, limit, out_dtype):
    """Best plain-torch path: per active expert, dequantize to float32 and matmul."""
    n_out = w.shape[1] // 2 if fuse else w.shape[1]
    out = torch.empty(a.shape[0], n_out, dtype=out_dtype, device=a.device)
    off = offsets.tolist()
    for e in range(w.shape[0]):
        lo, hi = off[e], off[e + 1]
        if hi == lo:
            continue
        y = a[lo:hi].float() @ dequantize_mxfp4(w[e], s[e]).T
        if fuse:
            g, u = y[:, :n_out].clamp(max=limit), y[:, n_out:].clamp(-limit, limit)
            y = torch.nn.functional.silu(g) * u
        out[lo:hi] = y
    return out


def routing_offsets(tokens, num_experts, skew, gen):
    """int32 offsets [E+1] of the expert-sorted rows for top-k routing of `tokens` tokens."""
    if skew:
        ids = torch.arange(TOPK).repeat(tokens, 1)
    else:
        ids = torch.rand(tokens, num_experts, generator=gen).topk(TOPK, dim=1).indices
    counts = torch.bincount(ids.reshape(-1), minlength=num_experts)
    return torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32)


def make_weights(num_experts, n, k, gen):
    """Random checkpoint bytes (every nibble) and scale bytes, made on gen's device."""
    dev = gen.device
    w = torch.randint(0, 256, (num_experts, n, k // 2), dtype=torch.uint8, generator=gen, device=dev)
    s = torch.randint(118, 124, (num_experts, n, k // 32), dtype=torch.uint8, generator=gen,
                      device=dev)
    return w, s


def main() -> None:
    args = bench.parse_args(__doc__)
    dev = args.device
    cuda = dev == "cuda"
    num_experts = EXPERTS if cuda else CPU_EXPERTS
    tokens_list = [1, 8, 64, 512, 2048, 8192] if cuda else [1, 8, 32]
    ceilings = bench.measure_cuda_ceilings() if cuda else None
    if cuda:
        timer = bench.time_cuda
        timer_torch = lambda f: bench.time_cuda(f, warmup=2, reps=10)  # noqa: E731
    else:
        # CPU machines here are shared: other jobs come and go. Take the best of a few medians
        # (the same for both sides) so a burst of foreign load does not decide the row.
        timer = lambda f: min(bench.time_cpu(f, warmup=1, reps=5) for _ in range(3))  # noqa: E731
        timer_torch = lambda f: min(bench.time_cpu(f, warmup=0, reps=1)  # noqa: E731
                                    for _ in range(3))
    gen = torch.Generator().manual_seed(0)                 # routing (on the host)
    dgen = torch.Generator(device=dev).manual_seed(1)      # weights and activations
    gemms = {
        "gate_up": (2 * INTER, HIDDEN, True),
        "down": (HIDDEN, INTER, False),
    }
    weights = {name: make_weights(num_experts, n, k, dgen) for name, (n, k, _) in gemms.items()}
    rows = []
    for tokens in tokens_list:
        for skew in (False, True) if cuda else (False,):
            offsets = routing_offsets(tokens, num_experts, skew, gen)
            m = int(offsets[-1])
            active = int((offsets[1:] > offsets[:-1]).sum())
            offsets_dev = offsets.to(dev)
            for name, (n, k, fuse) in gemms.items():
                w, s = weights[name]
                a = (torch.randn(m, k, generator=dgen, device=dev) * 0.5).to(torch.bfloat16)
                lim = LIMIT if fuse else None
                run = lambda: mxfp4_grouped_gemm(a, w, s, expert_offsets=offsets_dev,  # noqa: E731
                                                 fuse_swiglu=fuse, swiglu_limit=lim)
                run_torch = lambda: torch_grouped(a, w, s, offsets, fuse, LIMIT,  # noqa: E731
                                                  torch.bfloat16)
                # A fast wrong kernel must not post a number: check against the torch path first.
                got, want = run().float(), run_torch().float()
                err = float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30)
                assert err < 2e-2, f"{name} tokens={tokens}: relative error {err:.3g} vs torch"
                t = timer(run)
                t_torch = timer_torch(run_torch)
                n_out = n // 2 if fuse else n
                weight_bytes = active * n * (k // 2 + k // 32)
                moved = weight_bytes + m * k * a.element_size() + m * n_out * 2
                flops = 2.0 * m * n * k
                row = {
                    "gemm": name, "tokens": tokens, "routing": "skewed" if skew else "uniform",
                    "experts": num_experts, "active": active, "rows": m, "N": n, "K": k,
                    "weight_bytes": weight_bytes,
                    **bench.roofline_row(seconds=t, bytes_moved=moved, flops=flops,
                                         ceilings=ceilings),
                    "gflops": flops / t / 1e9,
                    "torch_us": t_torch * 1e6,
                    "speedup_vs_torch": t_torch / t,
                }
                rows.append(row)
                print(f"  {name} tokens={tokens} {'skewed' if skew else 'uniform'}: "
                      f"{t * 1e6:.0f} us (torch {t_torch * 1e6:.0f} us)", flush=True)
    cols = ["gemm", "tokens", "routing", "active", "rows", "N", "K", "weight_bytes", "flops",
            "time_us", "gbps", "gflops", "torch_us", "speedup_vs_torch"]
    if cuda:
        cols += ["floor_us", "fraction_of_floor"]
    bench.print_table(rows, cols)
    extra = {"ceilings": ceilings, "threads": None if cuda else _C.num_threads(),
             "note": "CUDA: interim torch path until the Hopper kernel lands" if cuda else
             f"CPU: C++ twin; {CPU_EXPERTS} of the 256 experts present; times are the best "
             "of 3 medians (kernel) / of 3 single calls after the check call (torch) on a "
             "shared machine"}
    path = bench.write_results("moe_gemm_cuda" if cuda else "moe_gemm_cpu", rows,
                               device="cuda" if cuda else "cpu", extra=extra,
                               out_dir=args.out_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
