#!/usr/bin/env bash
# Same-machine A/B of the batched throughput protocol against an earlier commit: the commit's tree arrives as
# a tar (`git archive REV -o .devdeps/base.tar`, carried), is built beside this one and run right after it.
#   bash bench/ab_baseline.sh [SHAPES...]     (default qwen2-0.5b qwen2-1.5b; logs in $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
here=$PWD
base=/tmp/llaisys-base
mkdir -p "$base" && tar -xf .devdeps/base.tar -C "$base"
cmake -S "$base" -B "$base/build/gpu" -G Ninja -DLLAISYS_CUDA=ON -DLLAISYS_CUDA_ARCHS=90 >"$OUT/base_build.log" 2>&1 &&
  cmake --build "$base/build/gpu" -j16 --target _core >>"$OUT/base_build.log" 2>&1 || { echo "baseline build failed"; exit 1; }
for shape in ${*:-qwen2-0.5b qwen2-1.5b}; do
  for side in base current; do
    if [ $side = base ]; then dir=$base; else dir=$here; fi
    echo "== $side $shape" | tee -a "$OUT/summary.txt"
    (cd "$dir" && LLAISYS_BUILD_DIR=$dir/build/gpu PYTHONPATH=$dir/python:${PYTHONPATH_EXTRA:-} timeout 200 \
      python3 bench/throughput.py --shape $shape --device cuda -n 256 2>&1 | grep -E "^batched|Error" |
      tee -a "$OUT/summary.txt")
  done
done
