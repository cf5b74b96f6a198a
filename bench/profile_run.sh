#!/usr/bin/env bash
# Nsight Compute on the H200 for one kernel launch (run after bench/run_h200.sh's build step):
# the full section set as text, and the per-SASS-instruction source page (stall samples,
# executed instructions) as gzipped CSV, under $OUT; read the CSV with bench/ncu_summary.py.
#   usage: bash bench/profile_run.sh <kernel regex> <python script> [args...]
#   e.g.   bash bench/profile_run.sh sparse_mla_fp8 bench/profile_sparse_mla.py 256 64 fp8
set -uo pipefail
OUT=${OUT:-/tmp/zeroinfer-out}
mkdir -p "$OUT"
regex=$1; shift
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
ncu --clock-control none --set full --import-source no -k "regex:$regex" -c 1 -f -o "$OUT/prof" \
  python3 "$@" > "$OUT/ncu_run.log" 2>&1
tail -5 "$OUT/ncu_run.log"
ncu -i "$OUT/prof.ncu-rep" --print-summary none > "$OUT/ncu_details.txt" 2>&1
ncu -i "$OUT/prof.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_source.csv" 2>&1
gzip -f "$OUT/ncu_source.csv"
rm -f "$OUT/prof.ncu-rep"
grep -E "Duration|Executed Ipc A|Issue Slots Busy|Warp Cycles Per Issued|Executed Instructions  |Memory Throughput|DRAM Throughput|Registers Per|Achieved Occupancy" "$OUT/ncu_details.txt"
