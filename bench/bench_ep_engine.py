"""The engine under expert parallelism: decode throughput over N ranks (a process each: NCCL
with a GPU each, gloo CPU ranks without), eager rounds against decode graphs (the MoE layers'
fixed-capacity exchange replayed from CUDA graphs; on the CPU the same fixed shapes, eagerly),
beside the single-device engine on one rank's batch.

  python bench/bench_ep_engine.py [--device cuda] [--ranks N] [--batch-sizes 1,8,64]

Every rank serves its own batch of the same workload (data-parallel attention), so the ranks
step together. Timed as `zeroinfer bench` times (engine/bench.py: the workload's second pass,
the zero-overhead pipeline on, the dummy model). `decode_tokens_per_s` is one rank's rate and
`group_tokens_per_s` the group's. The roofline of this benchmark is the single-device engine
on one rank's batch (`fraction_of_single_device`): expert parallelism adds a vote per round and
the exchange per MoE layer to the same work, so at one rank it can at best tie; with more
ranks, on one machine's CPUs, they share the cores.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from zeroinfer.testing import bench

MODEL = "dummy"


def _rank(rank: int, world: int, device: str, batches: list[int], input_len: int,
          output_len: int) -> list[dict]:
    from zeroinfer.engine.bench import _one
    from zeroinfer.model import load, model_config
    from zeroinfer.parallel import ExpertParallel

    dev = f"cuda:{rank}" if device == "cuda" else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    ep = ExpertParallel.for_model(model_config(MODEL), redundant_experts=world, device=dev)
    model = load(MODEL, dtype=dtype, device=dev, ep=ep)
    rows = []
    for b in batches:
        for graphs in (False, True):
            rows.append(_one(model, b, input_len, output_len, True, graphs, "auto"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--ranks", type=int, default=None,
                    help="default: every GPU (cuda), 2 (cpu)")
    ap.add_argument("--batch-sizes", default="1,8,64")
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--out-dir", default=None, type=Path)
    a = ap.parse_args()
    from zeroinfer.engine.bench import _one
    from zeroinfer.model import load
    from zeroinfer.parallel.launch import run_ranks

    cuda = a.device == "cuda"
    ranks = a.ranks or (torch.cuda.device_count() if cuda else 2)
    batches = [int(s) for s in a.batch_sizes.split(",")]
    per_rank = run_ranks(_rank, ranks, a.device, batches, a.input_len, a.output_len,
                         backend="nccl" if cuda else "gloo")
    dtype = torch.bfloat16 if cuda else torch.float32
    single = load(MODEL, dtype=dtype, device="cuda" if cuda else "cpu")
    base = {}
    for b in batches:
        for graphs in (False, True):
            base[b, graphs] = _one(single, b, a.input_len, a.output_len, True, graphs, "auto")
    rows = []
    for i, r in enumerate(per_rank[0]):
        each = [p[i]["decode_tokens_per_s"] for p in per_rank]
        ref = base[r["batch"], r["graphs"]]["decode_tokens_per_s"]
        rows.append({
            "batch_per_rank": r["batch"], "ranks": ranks, "graphs": r["graphs"],
            "decode_tokens_per_s": min(each), "group_tokens_per_s": sum(each),
            "single_device_tokens_per_s": ref,
            "fraction_of_single_device": min(each) / ref,
            "idle_gap_us_median": r["idle_gap_us_median"],
            "schedule_us_per_round": r["schedule_us_per_round"],
            "launch_us_per_round": r["launch_us_per_round"], "rounds": r["rounds"],
        })
        print(rows[-1], flush=True)
    bench.print_table(rows, ["batch_per_rank", "ranks", "graphs", "decode_tokens_per_s",
                             "group_tokens_per_s", "single_device_tokens_per_s",
                             "fraction_of_single_device", "launch_us_per_round", "rounds"])
    path = bench.write_results("ep_engine", rows, device=a.device,
                               extra={"model": MODEL, "dtype": str(dtype), "ranks": ranks,
                                      "input_len": a.input_len, "output_len": a.output_len},
                               out_dir=a.out_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
