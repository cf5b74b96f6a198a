"""A/B of the fused dispatch kernel's switches (ZEROINFER_DISPATCH_*, dispatch_combine.cu above
env_level) in ONE process, for Nsight Compute: every configuration x token count launches the
dispatch twice (read the second), in a fixed order that this script writes to --seq; then
--table turns ncu's CSV into one row per configuration (kernel durations in us).

  ncu --clock-control none --metrics gpu__time_duration.sum -k regex:dispatch_fused --csv \\
      --log-file $OUT/ncu_ab.csv python3 bench/profile_dispatch_ab.py --seq $OUT/ab_seq.json \\
      1 128 512 2048 8192
  python3 bench/profile_dispatch_ab.py --table $OUT/ncu_ab.csv --seq $OUT/ab_seq.json

V4-Flash routing: hidden 4096 bf16, 256 experts, top-6, tile 64, uniform random ids.
"""

from __future__ import annotations

import argparse
import csv
import json
import os

SWITCHES = ["FUSED", "NARROW", "BATCH", "SOLO", "BALANCE", "EARLY", "PREFETCH", "LATE"]
# name -> switches set (the rest unset = default). "main" = main's kernel (6d59f11); "s5" =
# session 5 as measured on the H200 (e2dc511); the others: one switch from the defaults.
CONFIGS = {
    "default": {},
    "main": {"NARROW": "0", "BATCH": "0", "SOLO": "0", "BALANCE": "0", "EARLY": "0", "LATE": "0"},
    "s5": {"BALANCE": "1", "EARLY": "1"},
    "NARROW=0": {"NARROW": "0"},
    "NARROW=0,BATCH=0": {"NARROW": "0", "BATCH": "0"},
    "SOLO=0": {"SOLO": "0"},
    "BALANCE=0": {"BALANCE": "0"},
    "BALANCE=1": {"BALANCE": "1"},
    "EARLY=0": {"EARLY": "0"},
    "EARLY=1": {"EARLY": "1"},
    "PREFETCH=0": {"PREFETCH": "0"},
    "LATE=0": {"LATE": "0"},
}
HIDDEN, EXPERTS, TOPK, TILE = 4096, 256, 6, 64


def run(sizes: list[int], seq_path: str) -> None:
    import torch

    from zeroinfer.ops import moe_dispatch

    seq = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for T in sizes:
        x = torch.randn(T, HIDDEN, device="cuda", generator=gen).bfloat16()
        ids = torch.rand(T, EXPERTS, device="cuda", generator=gen).topk(TOPK, dim=1).indices.int()
        for name, env in CONFIGS.items():
            for s in SWITCHES:
                os.environ.pop("ZEROINFER_DISPATCH_" + s, None)
            for s, v in env.items():
                os.environ["ZEROINFER_DISPATCH_" + s] = v
            for rep in range(2):
                moe_dispatch(x, ids, EXPERTS, tile=TILE)
                seq.append([name, T, rep])
            torch.cuda.synchronize()
        print("tokens", T, "done", flush=True)
    with open(seq_path, "w") as f:
        json.dump(seq, f)


def table(csv_path: str, seq_path: str) -> None:
    with open(seq_path) as f:
        seq = json.load(f)
    with open(csv_path) as f:
        lines = [ln for ln in f if ln.startswith('"')]
    rows = [r for r in csv.DictReader(lines) if r.get("Metric Name") == "gpu__time_duration.sum"]
    scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
    durs = [float(r["Metric Value"].replace(",", "")) * scale.get(r["Metric Unit"], 1.0)
            for r in sorted(rows, key=lambda r: int(r["ID"]))]
    if len(durs) != len(seq):
        print(f"WARNING: {len(durs)} profiled launches, {len(seq)} expected; table may be off")
    got = {}
    for (name, T, rep), d in zip(seq, durs):
        if rep == 1:
            got[(name, T)] = d
    sizes = sorted({T for _, T, _ in seq})
    names = list(dict.fromkeys(n for n, _, _ in seq))
    print("fused dispatch kernel, us (second launch; ncu, caches flushed)")
    print(f"{'config':<18}" + "".join(f"{T:>9}" for T in sizes) + "   vs default")
    for n in names:
        vals = [got.get((n, T)) for T in sizes]
        base = [got.get(("default", T)) for T in sizes]
        cells = "".join(f"{v:9.1f}" if v is not None else f"{'-':>9}" for v in vals)
        delta = " ".join(f"{v - b:+.1f}" if v is not None and b is not None else "-"
                         for v, b in zip(vals, base))
        print(f"{n:<18}{cells}   {delta}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sizes", nargs="*", type=int)
    ap.add_argument("--seq", required=True, help="launch order (written by a run, read by --table)")
    ap.add_argument("--table", help="ncu --csv log to summarise instead of running")
    args = ap.parse_args()
    if args.table:
        table(args.table, args.seq)
    else:
        run(args.sizes or [1, 128, 512, 2048, 8192], args.seq)
