#!/usr/bin/env bash
# A/B of CUDA source variants in one device call: the tree's own build (`ZI_STEPS=build bash
# bench/run_h200.sh` first) and a side build per variant - a copy of the tree with one source file
# replaced - then a case script run under each build in turn (one process a build), ROUNDS times
# alternated, so that clocks and neighbours drift alike for all of them. Prints "name {json}"
# lines, "tree" being the tree's build (bench/ab_moe_cases.py prints kernel us and a checksum a
# case).
#   bash bench/ab_builds.sh ROUNDS "SCRIPT [ARGS]" NAME=ALT.cu[@TARGET][,ALT2@TARGET2 ...] ...
#   e.g. bash bench/ab_builds.sh 2 "bench/ab_moe_cases.py gate_up:512:skewed,down:512:skewed" \
#          main=/path/to/main_moe_gemm.cu
# TARGET (the file ALT replaces) defaults to csrc/cuda/moe_gemm.cu; a variant may replace several
# files (ALT@TARGET pairs, comma-separated). A variant's source travels to
# the device as a file (the device copy has no .git): `git show REF:csrc/cuda/moe_gemm.cu > FILE`.
set -uo pipefail
rounds=$1 script=$2
shift 2
names=(tree)
mkdir -p /tmp/ab/tree && rm -rf /tmp/ab/tree/zeroinfer && cp -r python/zeroinfer /tmp/ab/tree/
for spec in "$@"; do
  name=${spec%%=*}
  src=/tmp/ab/src_$name
  rm -rf "$src" "/tmp/ab/$name" && mkdir -p "$src" "/tmp/ab/$name"
  cp -r CMakeLists.txt cmake csrc python ascend "$src"/
  IFS=, read -ra pairs <<< "${spec#*=}"
  for rest in "${pairs[@]}"; do
    alt=${rest%%@*} target=csrc/cuda/moe_gemm.cu
    [[ $rest == *@* ]] && target=${rest#*@}
    cp "$alt" "$src/$target"
  done
  cp -r python/zeroinfer "/tmp/ab/$name/" && rm -f "/tmp/ab/$name"/zeroinfer/_C*.so
  (cd "$src" && cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DZEROINFER_CUDA=ON \
     -DPython_EXECUTABLE="$(which python3)" -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" \
     -DZEROINFER_OUTPUT_DIR="/tmp/ab/$name/zeroinfer" > "/tmp/ab/build_$name.log" 2>&1 &&
     cmake --build build -j16 --target _C >> "/tmp/ab/build_$name.log" 2>&1) ||
    { tail -20 "/tmp/ab/build_$name.log"; exit 1; }
  names+=("$name")
done
for ((r = 0; r < rounds; r++)); do
  for name in "${names[@]}"; do
    # shellcheck disable=SC2086  # the script and its arguments are one string on purpose
    out=$(PYTHONPATH=/tmp/ab/$name${PYTHONPATH:+:$PYTHONPATH} python3 $script 2>&1 | tail -1)
    echo "$name $out"
  done
done
