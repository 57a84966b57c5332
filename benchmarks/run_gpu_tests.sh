#!/usr/bin/env bash
# The tests that run on a GPU, one pytest process per file, all at once: the kernels they compile on first use keep
# the CPUs busy while others run on the GPU, so the suite takes about its longest file (~6 minutes on the lent
# Hopper machine with 16 cores) instead of the sum (~35). Files with GPU-marked tests run those (their CPU cases
# run in CI); files that only use a GPU where there is one run whole. OUTDIR gets summary.txt (each file's last
# line) and failures.txt (the failing tests' reports); the full logs and JUnit XML stay in OUTDIR/logs.
#   bash benchmarks/run_gpu_tests.sh OUTDIR [pytest args, e.g. -x]
set -uo pipefail
OUT=${1:?usage: run_gpu_tests.sh OUTDIR [pytest args]}; shift
LOGS=${LOGS:-$OUT/logs}
mkdir -p "$OUT" "$LOGS"
source benchmarks/gpu_env.sh "$OUT"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/device.txt" 2>&1
MARKED=$(grep -rl "mark.gpu" tests --include='test_*.py' | grep -v '/interpreter/' | sort)
USES=$(grep -rlE "cuda.is_available|needs_gpu" tests --include='test_*.py' | grep -v '/interpreter/' | sort)
WHOLE=$(comm -13 <(echo "$MARKED") <(echo "$USES"))
name() { echo "${1#tests/}" | tr '/' '_' | sed 's/\.py$//'; }
for f in $MARKED; do
  python3 -m pytest "$f" -m gpu -q -p no:cacheprovider --junitxml="$LOGS/$(name "$f").xml" "$@" > "$LOGS/$(name "$f").log" 2>&1 &
done
for f in $WHOLE; do
  python3 -m pytest "$f" -q -p no:cacheprovider --junitxml="$LOGS/$(name "$f").xml" "$@" > "$LOGS/$(name "$f").log" 2>&1 &
done
wait
: > "$OUT/failures.txt"
for f in $MARKED $WHOLE; do
  log="$LOGS/$(name "$f").log"
  printf '%-50s %s\n' "$f" "$(tail -n 1 "$log")"
  if grep -q "^FAILED\|^ERROR" "$log"; then
    { echo "=== $f"; sed -n '/^=* FAILURES =*$/,/^=* short test summary/p' "$log" | grep -E "^(E |____|>)" | head -n 60
      grep -E "^(FAILED|ERROR)" "$log"; } >> "$OUT/failures.txt"
  fi
done | tee "$OUT/summary.txt"
