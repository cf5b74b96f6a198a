#!/usr/bin/env bash
# One call on the lent H200: build zeroinfer._C with CUDA (sm_90a), run the tests (GPU ones
# included), compute-sanitizer on bench/sanitize_cases.py, the CUDA benchmarks and the engine
# benchmark. Everything goes under $OUT: logs, and the benchmark JSON of this card's folder
# (bench.machine_name: h200, or e.g. h100-80gb-hbm3 when the pool lends an H100) packed as
# $OUT/results.tgz (the device tool returns at most 8 files) to be unpacked into bench/results/.
#   usage (device machine, repo root): bash bench/run_h200.sh [pytest args...]
#   ZI_STEPS   which steps, default "build tests sanitize bench engine"
#   ZI_BENCH   benchmark scripts, default every bench/bench_*.py
set -uo pipefail
OUT=${OUT:-/tmp/zeroinfer-out}
STEPS=${ZI_STEPS:-build tests sanitize bench engine}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
# The device's copy of the tree may carry stale git metadata: the results' commit comes from
# .device/commit (written before the call) where there is one.
[[ -z "${ZEROINFER_COMMIT:-}" && -f .device/commit ]] && export ZEROINFER_COMMIT=$(cat .device/commit)
has() { [[ " $STEPS " == *" $1 "* ]]; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; python3 -c 'import torch;print(torch.__version__)'; } 2>&1 | tee "$OUT/env.log"

if has build; then
  t0=$(date +%s)
  # A warm device machine keeps build/h200, and the copied sources keep the other machine's
  # modification times: after a build from other source text (an A/B that swapped a file in and
  # rebuilt), those objects look newer than the sources and ninja would keep them. So every
  # source is made new (a full rebuild, ~15-25 s on 16 cores) whenever a build is there.
  [[ -d build/h200 ]] && find csrc -type f -exec touch {} +
  cmake -S . -B build/h200 -G Ninja -DCMAKE_BUILD_TYPE=Release -DZEROINFER_CUDA=ON \
    -DPython_EXECUTABLE="$(which python3)" -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" \
    -DZEROINFER_OUTPUT_DIR="$PWD/python/zeroinfer" > "$OUT/build.log" 2>&1 &&
    cmake --build build/h200 -j16 >> "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
fi
python3 -c 'import zeroinfer, json; print(json.dumps(zeroinfer.build_info()))' | tee -a "$OUT/env.log"
# The results folder of this card, as the benchmarks name it (bench/results/<machine>/).
MACHINE=$(python3 -c 'from zeroinfer.testing.bench import machine_name; print(machine_name("cuda"))')
mkdir -p "$OUT/$MACHINE"

if has tests; then
  ZEROINFER_EXPECT_CUDA=1 ZEROINFER_RESULTS_DIR="$OUT/$MACHINE" python3 -m pytest -q -p no:cacheprovider \
    "${@:-tests}" 2>&1 | tee "$OUT/pytest.log" | grep -vE '^(PASSED|SKIPPED)' | tail -40
  # The exception-boundary diagnostic (bench/diag_exceptions.py): C++ exceptions out of _C used
  # to crash on this image; it checks every import order and throw path in child processes.
  python3 bench/diag_exceptions.py > "$OUT/diag_exceptions.log" 2>&1
  sed -n '/=== summary/,$p' "$OUT/diag_exceptions.log" | head -30
fi

if has sanitize; then
  for tool in memcheck racecheck; do
    echo "== $tool" >> "$OUT/sanitizer.log"
    compute-sanitizer --tool "$tool" --error-exitcode 9 python3 bench/sanitize_cases.py \
      > "$OUT/sanitizer_$tool.tmp" 2>&1
    echo "compute-sanitizer $tool: exit $?; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_$tool.tmp")"
    cat "$OUT/sanitizer_$tool.tmp" >> "$OUT/sanitizer.log" && rm "$OUT/sanitizer_$tool.tmp"
  done
fi

if has bench; then
  for b in ${ZI_BENCH:-bench/bench_*.py}; do
    echo "== $b"
    python3 "$b" --device cuda --out-dir "$OUT" 2>&1 | tee -a "$OUT/bench.log" | tail -30
  done
fi
if has engine; then
  # The engine: decode throughput and device idle gaps with the zero-overhead pipeline on / off.
  python3 -m zeroinfer bench --device cuda --batch-sizes "${ZI_ENGINE_BATCHES:-1,8,32,64,128,256}" \
    --output-len 32 --out-dir "$OUT" 2>&1 | tee -a "$OUT/bench.log" | tail -25
fi
# Pack this run's JSON (only when a step that writes some ran: a build-only call, as the device
# scripts make before their own benchmarks, must leave an earlier benchmark's files in place).
if has tests || has bench || has engine; then
  tar czf "$OUT/results.tgz" -C "$OUT" "$MACHINE" && rm -r "${OUT:?}/$MACHINE"
fi
