"""Benchmark the routed experts of one MoE layer at decode, as the model launches them (W4A16):
the dispatch path against the routed path.

  python bench/bench_moe_layer.py                  # CPU: the C++ twins, 16 experts
  python bench/bench_moe_layer.py --device cuda    # sm_90a kernels, V4-Flash's 256 experts

  dispatch: moe_dispatch -> gate_up (fused clipped SwiGLU) -> down -> moe_combine (token_row)
  routed:   gate_up -> down -> moe_combine, the GEMMs given the router's ids (the routed layout:
            every CTA sorts the ids itself, zeroinfer/moe_gemm.h), no dispatch launch

V4-Flash shapes: hidden 4096, intermediate 2048, top-6, bf16 activations, MXFP4 weights prepacked
once (not timed); tokens 1, 8, 32 and 42 (T*k <= MXFP4_ROUTED_MAX_ROWS = 256, where the model
takes the routed path), routing uniform (random distinct top-6) and skewed (every token on the
same 6 experts). The two paths must agree bitwise before either is timed.

Bytes: the packed weights of the active experts (4.25 bits a weight) plus the activations each
step must move (x, h and the expert outputs written and read once, the layer's output); the
floor is bytes / the measured copy rate (decode is weight-bound). time_us: CUDA-graph replay with
L2 flushed before each call; kernel_us: the path's own device work (busy time of its kernels,
bench.time_kernels); speedup = the dispatch path's time over the routed path's, per column.
"""

from __future__ import annotations

import torch

from zeroinfer.ops import MXFP4_ROUTED_MAX_ROWS, moe_combine, moe_dispatch, mxfp4_grouped_gemm
from zeroinfer.ops import mxfp4_prepack
from zeroinfer.testing import bench

HIDDEN, INTER, TOPK, LIMIT = 4096, 2048, 6, 10.0
CUDA_EXPERTS, CPU_EXPERTS = 256, 16
TOKENS = (1, 8, 32, 42)


def make_weights(num_experts, n, k, gen):
    """Random checkpoint bytes (every nibble) and V4-like scale bytes, on gen's device."""
    u8 = dict(dtype=torch.uint8, generator=gen, device=gen.device)
    return (torch.randint(0, 256, (num_experts, n, k // 2), **u8),
            torch.randint(118, 124, (num_experts, n, k // 32), **u8))


def routing(T, experts, skew, gen, device):
    if skew:  # every token's k slots on the first k experts
        return torch.arange(TOPK, dtype=torch.int32).repeat(T, 1).to(device)
    scores = torch.rand(T, experts, generator=gen)
    return scores.topk(TOPK, dim=1).indices.to(torch.int32).to(device)


def paths(x, ids, wt, w1, w2, experts):
    """(dispatch path, routed path): each returns the layer's routed-expert output [T, D]."""
    def dispatched():
        d = moe_dispatch(x, ids, experts)
        seg = dict(expert_offsets=d.expert_offsets, expert_counts=d.expert_counts)
        h = mxfp4_grouped_gemm(d.sorted_x, *w1, fuse_swiglu=True, swiglu_limit=LIMIT, **seg)
        return moe_combine(mxfp4_grouped_gemm(h, *w2, **seg), d.token_row, wt)

    def routed():
        h = mxfp4_grouped_gemm(x, *w1, topk_ids=ids, fuse_swiglu=True, swiglu_limit=LIMIT)
        return moe_combine(mxfp4_grouped_gemm(h, *w2, topk_ids=ids), None, wt, topk_ids=ids)

    return dispatched, routed


def main() -> None:
    args = bench.parse_args(__doc__)
    dev = args.device
    cuda = dev == "cuda"
    experts = CUDA_EXPERTS if cuda else CPU_EXPERTS
    assert max(TOKENS) * TOPK <= MXFP4_ROUTED_MAX_ROWS
    ceilings = bench.measure_cuda_ceilings() if cuda else None
    gen = torch.Generator().manual_seed(0)
    wgen = torch.Generator(device=dev).manual_seed(1)
    raw1 = make_weights(experts, 2 * INTER, HIDDEN, wgen)
    raw2 = make_weights(experts, HIDDEN, INTER, wgen)
    if cuda:  # the kernel's layout, once (as the model keeps it)
        p1 = mxfp4_prepack(*raw1, fuse_swiglu=True, act_dtype=torch.bfloat16)
        p2 = mxfp4_prepack(*raw2, act_dtype=torch.bfloat16)
        w1, w2 = (p1, None), (p2, None)
        packed_bytes = (p1.n_pad * p1.k_pad + p2.n_pad * p2.k_pad) * 17 // 32  # an expert
    else:
        w1, w2 = raw1, raw2
        packed_bytes = (2 * INTER * HIDDEN + HIDDEN * INTER) * 17 // 32
    rows = []
    for T in TOKENS:
        for skew in (False, True):
            x = (torch.randn(T, HIDDEN, generator=gen) * 0.5).to(device=dev, dtype=torch.bfloat16)
            ids = routing(T, experts, skew, gen, dev)
            wt = torch.rand(T, TOPK, generator=gen).to(dev)
            dispatched, routed = paths(x, ids, wt, w1, w2, experts)
            # A fast wrong path must not post a number: the two agree bitwise, and are finite.
            want, got = dispatched(), routed()
            assert torch.isfinite(want).all(), f"T={T}: non-finite layer output"
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), \
                f"T={T} skew={skew}: the routed path differs from the dispatch path"
            active = int(torch.unique(ids).numel())
            weight_bytes = active * packed_bytes
            act_bytes = 2 * (T * HIDDEN + 2 * T * TOPK * INTER + 2 * T * TOPK * HIDDEN
                             + T * HIDDEN)
            flops = 2.0 * T * TOPK * (2 * INTER * HIDDEN + HIDDEN * INTER)
            times = {}
            for name, fn in (("dispatch", dispatched), ("routed", routed)):
                if cuda:
                    t = bench.time_cuda_graph(fn, warmup=3, reps=30)
                    t_kern = bench.time_kernels(fn, reps=30)
                else:
                    t, t_kern = bench.time_cpu(fn, warmup=1, reps=5), None
                times[name] = (t, t_kern)
                row = {"path": name, "tokens": T, "routing": "skewed" if skew else "uniform",
                       "experts": experts, "active": active, "weight_bytes": weight_bytes,
                       **bench.roofline_row(seconds=t, bytes_moved=weight_bytes + act_bytes,
                                            flops=flops, ceilings=ceilings,
                                            kernel_seconds=t_kern)}
                if name == "routed":
                    t_d, k_d = times["dispatch"]
                    row["speedup_vs_dispatch"] = t_d / t
                    if t_kern is not None:
                        row["kernel_speedup_vs_dispatch"] = k_d / t_kern
                rows.append(row)
                print(f"  {name} T={T} {row['routing']}: {t * 1e6:.1f} us"
                      + ("" if t_kern is None else f", kernels {t_kern * 1e6:.1f} us")
                      + ("" if row["fraction_of_floor"] is None else
                         f" ({row['fraction_of_floor']:.0%} of the floor)"), flush=True)
    cols = ["path", "tokens", "routing", "active", "bytes", "time_us", "gbps", "floor_us",
            "fraction_of_floor", "speedup_vs_dispatch"]
    if cuda:
        cols += ["kernel_us", "kernel_fraction_of_floor", "kernel_speedup_vs_dispatch"]
    bench.print_table(rows, cols)
    extra = {"ceilings": ceilings, "hidden": HIDDEN, "intermediate": INTER, "topk": TOPK,
             "swiglu_limit": LIMIT,
             "bytes": "packed MXFP4 weights of the active experts (gate_up + down) + bf16 "
                      "activations: x, h written and read, expert outputs written and read, the "
                      "layer output",
             "timing": "time_us: CUDA-graph replay, L2 flushed before each call; kernel_us: the "
                       "path's own device work (busy time, bench.time_kernels)"
                       if cuda else "median wall time"}
    path = bench.write_results("moe_layer", rows, device=dev, extra=extra, out_dir=args.out_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
