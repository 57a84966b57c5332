#!/usr/bin/env bash
# The GPU-marked tests, one pytest process per file, all at once: the kernels they compile on first use keep
# the CPUs busy while others run on the GPU, so the suite takes about its longest file (~5 minutes on the lent
# Hopper machine) instead of the sum (~35). Each file's log and JUnit XML go to OUTDIR; the summary line of each
# is printed at the end. Usage: benchmarks/run_gpu_tests.sh OUTDIR [pytest args, e.g. -x]
set -uo pipefail
OUT=${1:?usage: run_gpu_tests.sh OUTDIR [pytest args]}; shift
mkdir -p "$OUT"
source benchmarks/gpu_env.sh "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/device.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/device.txt" 2>&1
FILES=$(grep -rl "mark.gpu" tests --include='test_*.py' | grep -v '/interpreter/' | sort)
for f in $FILES; do
  name=$(echo "${f#tests/}" | tr '/' '_' | sed 's/\.py$//')
  python3 -m pytest "$f" -m gpu -q -p no:cacheprovider --junitxml="$OUT/$name.xml" "$@" > "$OUT/$name.log" 2>&1 &
done
wait
for f in $FILES; do
  name=$(echo "${f#tests/}" | tr '/' '_' | sed 's/\.py$//')
  printf '%-50s %s\n' "$f" "$(tail -n 1 "$OUT/$name.log")"
done | tee "$OUT/summary.txt"
