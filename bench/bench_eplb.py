"""Benchmark the expert-parallel load balancer (zeroinfer.parallel.rebalance) at V4-Flash's MoE
sizes: 256 routed experts, 6 a token, 8-64 ranks, with and without redundant slots.

  python bench/bench_eplb.py

The load is synthetic and skewed the way routed MoE load is: each layer's expert popularity is
lognormal(0, 0.6) (the busiest expert ~4-5x the mean, as a bias-balanced router still leaves it),
each step routes 4096 tokens x 6 experts by it
(multinomial draws), and the popularity drifts between windows (x lognormal(0, 0.3) per
expert). A rebalance sees one 100-step window (DeepInfer's default) and is scored on it and on
the next, drifted, window, which is what it serves.

An EP MoE layer waits for its most loaded rank, so the balance is reported as `imbalance` (the
summed per-step peak rank load / the summed mean; 1.0 is ideal) and `efficiency` = 1 /
imbalance: the fraction of the ideal (perfectly balanced) MoE throughput, this benchmark's
roofline. `seconds_per_layer`: the host time of one layer's rebalance (the engine pauses that
long times the MoE layers). `dispatch_rows_per_token`: rows a token sends (one per distinct rank
among its experts' replicas; at most min(6, ranks)).
"""

from __future__ import annotations

import time

import torch

from zeroinfer.parallel import (imbalance, initial_placement, num_physical_experts, rank_loads,
                                rebalance)
from zeroinfer.testing import bench

EXPERTS, TOPK, TOKENS, WINDOW, LAYERS = 256, 6, 4096, 100, 4


def _window(gen, popularity):
    """[WINDOW, LAYERS, EXPERTS] routed-pair counts drawn from the per-layer popularity."""
    draws = torch.multinomial(popularity.repeat_interleave(WINDOW, 0), TOKENS * TOPK,
                              replacement=True, generator=gen)
    counts = torch.zeros(LAYERS * WINDOW, EXPERTS, dtype=torch.int64)
    counts.scatter_add_(1, draws, torch.ones_like(draws))
    return counts.view(LAYERS, WINDOW, EXPERTS).transpose(0, 1).contiguous()


def _rows_per_token(gen, popularity, placement):
    """Mean distinct destination ranks of a token's top-6 (replica = slot order by turn)."""
    pl = placement
    S = pl.slots_per_rank
    total = 0.0
    for layer in range(LAYERS):
        ids = torch.multinomial(popularity[layer].expand(TOKENS, -1), TOPK, generator=gen)
        turn = torch.arange(ids.numel()).view(ids.shape)
        phys = pl.logical_to_phys[layer][ids, turn % pl.logical_count[layer][ids]]
        ranks = phys // S
        total += float((torch.sort(ranks, 1).values.diff(1) != 0).sum(1).add(1).double().mean())
    return total / LAYERS


def main() -> None:
    args = bench.parse_args(__doc__)
    gen = torch.Generator().manual_seed(0)
    pop = torch.exp(0.6 * torch.randn(LAYERS, EXPERTS, generator=gen, dtype=torch.float64))
    seen = _window(gen, pop)
    drifted = pop * torch.exp(0.3 * torch.randn(pop.shape, generator=gen, dtype=torch.float64))
    served = _window(gen, drifted)
    rows = []
    for ranks in (8, 16, 32, 64):
        for extra in (0, 32):
            P = num_physical_experts(EXPERTS, ranks, extra)
            start = initial_placement(LAYERS, EXPERTS, P, ranks)
            t0 = time.perf_counter()
            pl = rebalance(seen, P, ranks)
            sec = (time.perf_counter() - t0) / LAYERS
            peak_share = float(rank_loads(served, pl).max(2).values.sum()
                               / served.double().sum())
            row = {"ranks": ranks, "slots": P, "redundant": P - EXPERTS, "window": WINDOW,
                   "tokens_per_step": TOKENS, "topk": TOPK,
                   "imbalance_initial": imbalance(served, start),
                   "imbalance_seen": imbalance(seen, pl),
                   "imbalance": imbalance(served, pl),
                   "peak_rank_share": peak_share,
                   "seconds_per_layer": sec,
                   "dispatch_rows_per_token": _rows_per_token(gen, drifted, pl)}
            row["efficiency"] = 1.0 / row["imbalance"]
            rows.append(row)
    bench.print_table(rows, ["ranks", "slots", "imbalance_initial", "imbalance_seen", "imbalance",
                             "efficiency", "seconds_per_layer", "dispatch_rows_per_token"])
    extra = {"load": "lognormal(0, 0.6) expert popularity per layer, 4096 tokens x top-6 a step "
                     "by multinomial draws; scored on the next window after a lognormal(0, 0.3) "
                     "drift", "layers_timed": LAYERS}
    path = bench.write_results("eplb", rows, device="cpu", extra=extra, out_dir=args.out_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
