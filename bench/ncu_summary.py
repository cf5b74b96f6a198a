"""Summarise the per-instruction CSV that bench/profile_run.sh writes (ncu --page source
--print-source sass, gzipped): stall reasons over the kernel, the instructions with the most
stall samples, and samples / executed instructions per block of SASS lines, so that time can
be assigned to code regions (the phases of a kernel's main loop).

  python3 bench/ncu_summary.py ncu_source.csv.gz [--work-units N] [--block 100] [--top 20]

--work-units divides executed instructions (e.g. by the number of 64-entry tiles) so that the
per-block column reads "warp instructions per unit of work".
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip


def _int(row: list[str], col: int) -> int:
    try:
        return int(row[col])
    except (ValueError, IndexError):
        return 0


def _opcode(sass: str) -> str:
    words = sass.strip().split()
    if words and words[0].startswith("@"):  # predicate guard
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv_gz")
    ap.add_argument("--work-units", type=float, default=1.0)
    ap.add_argument("--block", type=int, default=100, help="SASS lines per region row")
    ap.add_argument("--top", type=int, default=20, help="instructions with the most samples")
    args = ap.parse_args()

    with gzip.open(args.csv_gz, "rt") as f:
        rows = list(csv.reader(f))
    header = next(r for r in rows if "Address" in r and "Source" in r)
    data = rows[rows.index(header) + 1:]
    col = {name: i for i, name in enumerate(header)}
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    samples_col, exec_col = col["Warp Stall Sampling (All Samples)"], col["Instructions Executed"]

    totals = collections.Counter()
    for r in data:
        for s in stalls:
            totals[s] += _int(r, col[s])
    n_samples = sum(totals.values()) or 1
    n_exec = sum(_int(r, exec_col) for r in data)
    print(f"samples {n_samples}, warp instructions executed {n_exec} "
          f"({n_exec / args.work_units:.0f} per work unit)")
    for name, v in totals.most_common(10):
        print(f"  {name[6:]:20s} {v:8d} {v / n_samples:6.1%}")

    print(f"\nper {args.block} SASS lines: samples, executed per work unit, commonest opcodes")
    for b0 in range(0, len(data), args.block):
        part = data[b0:b0 + args.block]
        s = sum(_int(r, samples_col) for r in part)
        e = sum(_int(r, exec_col) for r in part) / args.work_units
        ops = collections.Counter(_opcode(r[1]) for r in part).most_common(4)
        print(f"  {b0:5d} {s:6d} {s / n_samples:6.1%} {e:9.0f}  "
              + " ".join(f"{o}:{c}" for o, c in ops))

    print(f"\ntop {args.top} instructions by stall samples")
    top = sorted(range(len(data)), key=lambda i: -_int(data[i], samples_col))[:args.top]
    for i in sorted(top):
        r = data[i]
        reasons = sorted(((_int(r, col[s]), s[6:]) for s in stalls), reverse=True)[:2]
        print(f"  {i:5d} {r[1].strip()[:58]:58s} {_int(r, samples_col):6d} "
              + ", ".join(f"{n} {v}" for v, n in reasons if v))


if __name__ == "__main__":
    main()
