"""Benchmark moe_dispatch / moe_combine against the best plain-torch path on the same inputs.

  python bench/bench_dispatch_combine.py                 # CPU: C++ twin vs torch (CPU)
  python bench/bench_dispatch_combine.py --device cuda   # CUDA kernels vs torch, roofline

V4-Flash routing shapes: hidden 4096 (bf16), 256 experts, top-6. Bytes are the fewest a kernel
must move (dispatch_bytes / combine_bytes below): dispatch reads x once and the ids and writes
T*k rows plus its index outputs (token_row, row_token over the whole capacity, counts, offsets);
combine reads T*k rows, token_row and the weights and writes T rows. The fraction is that floor
(bytes / measured copy bandwidth) over the measured time, i.e. achieved GB/s / ceiling.

Each case is timed twice on CUDA: `time_us` is the eager Python call (argument checks, output
allocation and launches included, L2 flushed before each call); `graph_us` replays the same call
captured in a CUDA graph (what a captured decode step pays: no Python, no launch gaps).
"""

from __future__ import annotations


import torch

from zeroinfer.ops import moe_combine, moe_dispatch
from zeroinfer.testing import bench

HIDDEN, EXPERTS, TOPK, TILE = 4096, 256, 6, 64


def torch_dispatch(x, ids, num_experts, tile):
    """Plain torch: stable sort by expert, tile-aligned offsets, index_select gather."""
    flat = ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + tile - 1) // tile * tile
    starts = torch.cumsum(padded, 0) - padded
    first = torch.cumsum(counts, 0) - counts
    sorted_e = flat[order]
    rows = starts[sorted_e] + torch.arange(order.numel(), device=x.device) - first[sorted_e]
    out = torch.empty(flat.numel() + min(num_experts, flat.numel()) * (tile - 1), x.shape[1], dtype=x.dtype,
                      device=x.device)
    out[rows] = x.index_select(0, order // ids.shape[1])
    token_row = torch.empty_like(flat)
    token_row[order] = rows
    return out, token_row.view_as(ids)


def torch_combine(expert_out, token_row, w):
    rows = expert_out.index_select(0, token_row.reshape(-1).long()).view(*token_row.shape, -1)
    return (rows.float() * w[..., None]).sum(1).to(expert_out.dtype)


def dispatch_bytes(T, hidden, topk, num_experts, es, ids_es, capacity):
    """x read once + ids read + T*k rows written + token_row, row_token, counts, offsets."""
    return (T * hidden * es + T * topk * ids_es + T * topk * hidden * es
            + T * topk * 4 + capacity * 4 + (2 * num_experts + 1) * 4)


def combine_bytes(T, hidden, topk, in_es, out_es, w_es):
    """T*k expert rows + token_row + weights read, T rows written."""
    return T * topk * (hidden * in_es + 4 + w_es) + T * hidden * out_es


def time_graph(fn):
    """bench.time_cuda_graph of fn, or None (reported) if the call cannot be captured."""
    try:
        return bench.time_cuda_graph(fn)
    except Exception as e:  # noqa: BLE001 - report, do not hide the eager number
        print(f"graph capture failed: {type(e).__name__}: {e}")
        return None


def routing(T, skew, device, gen):
    if skew:  # every token's k slots on the first k experts
        return torch.arange(TOPK, dtype=torch.int32, device=device).repeat(T, 1)
    scores = torch.rand(T, EXPERTS, generator=gen).to(device)
    return scores.topk(TOPK, dim=1).indices.to(torch.int32)


def main() -> None:
    args = bench.parse_args(__doc__)
    dev = args.device
    cuda = dev == "cuda"
    tokens = [1, 8, 32, 128, 512, 2048, 8192] if cuda else [1, 32, 512, 2048]
    ceilings = bench.measure_cuda_ceilings() if cuda else None
    timer = bench.time_cuda if cuda else bench.time_cpu
    gen = torch.Generator().manual_seed(0)
    rows = []
    for T in tokens:
        for skew in (False, True):
            x = torch.randn(T, HIDDEN, generator=gen).to(device=dev, dtype=torch.bfloat16)
            ids = routing(T, skew, dev, gen)
            w = torch.rand(T, TOPK, generator=gen).to(dev)
            d = moe_dispatch(x, ids, EXPERTS, tile=TILE)
            # A fast wrong kernel must not post a number: check against the torch path first.
            ref_sorted, ref_token_row = torch_dispatch(x, ids, EXPERTS, TILE)
            assert torch.equal(d.token_row, ref_token_row.to(torch.int32))
            used = d.row_token >= 0
            assert torch.equal(d.sorted_x[used], ref_sorted[used])
            eo = torch.randn(d.sorted_x.shape, generator=gen).to(device=dev, dtype=torch.bfloat16)
            got = moe_combine(eo, d.token_row, w).float()
            assert torch.allclose(got, torch_combine(eo, d.token_row, w).float(), rtol=2e-2, atol=2e-2)
            es = x.element_size()
            comb_out = torch.empty(T, HIDDEN, dtype=eo.dtype, device=dev)
            cases = {
                "dispatch": (lambda: moe_dispatch(x, ids, EXPERTS, tile=TILE),
                             lambda: moe_dispatch(x, ids, EXPERTS, tile=TILE, out=d),
                             lambda: torch_dispatch(x, ids, EXPERTS, TILE),
                             dispatch_bytes(T, HIDDEN, TOPK, EXPERTS, es, ids.element_size(),
                                            d.row_token.numel())),
                "combine": (lambda: moe_combine(eo, d.token_row, w),
                            lambda: moe_combine(eo, d.token_row, w, out=comb_out),
                            lambda: torch_combine(eo, d.token_row, w),
                            combine_bytes(T, HIDDEN, TOPK, eo.element_size(), es,
                                          w.element_size())),
            }
            for name, (ours, ours_out, ref, nbytes) in cases.items():
                t_ours, t_torch = timer(ours), timer(ref)
                t_graph = time_graph(ours_out) if cuda else None
                t_kern = bench.time_kernels(ours_out) if cuda else None
                row = {"op": name, "tokens": T, "routing": "skewed" if skew else "uniform",
                       "hidden": HIDDEN, "experts": EXPERTS, "topk": TOPK, "tile": TILE,
                       **bench.roofline_row(seconds=t_ours, bytes_moved=nbytes, flops=0,
                                            ceilings=ceilings, kernel_seconds=t_kern),
                       "torch_us": t_torch * 1e6, "speedup_vs_torch": t_torch / t_ours}
                if t_graph is not None:
                    g = bench.roofline_row(seconds=t_graph, bytes_moved=nbytes, flops=0,
                                           ceilings=ceilings)
                    row.update(graph_us=g["time_us"], graph_gbps=g["gbps"],
                               graph_fraction=g["fraction_of_floor"])
                rows.append(row)
    cols = ["op", "tokens", "routing", "bytes", "time_us", "gbps", "fraction_of_floor"]
    cols += ["graph_us", "graph_gbps", "graph_fraction", "kernel_us",
             "kernel_fraction_of_floor"] if cuda else []
    cols += ["torch_us", "speedup_vs_torch"]
    bench.print_table(rows, cols)

    path = bench.write_results("dispatch_combine", rows, device=dev,
                               extra={"ceilings": ceilings,
                                      "timing": "time_us: the op called eagerly, CUDA events, L2 "
                                      "flushed before each call; graph_us: its CUDA-graph replay; "
                                      "kernel_us: its own device work (CUPTI kernel durations, "
                                      "bench.time_kernels), kernel_fraction_of_floor on it"
                                      if cuda else "median wall time"},
                               out_dir=args.out_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
