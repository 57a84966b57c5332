#!/usr/bin/env bash
# Start-up and dispatch on the lent GPU, one after another (no timing beside a compile): the first call after a
# build in fresh processes (benchmarks/first_call.py with and without the self-check, benchmarks/startup.py with
# REPEATS processes per configuration, default 2), with SWEEP=1 the d=64 causal tiles with and without
# PERSISTENT_CAUSAL (benchmarks/sweep_cute_sm90.py), then attnforge's automatic
# choice against every backend and stock SDPA on the model shapes and the standard grid (benchmarks/dispatch_check.py,
# its JSON written after every row). Usage: benchmarks/run_dispatch.sh OUTDIR
set -uo pipefail
OUT=${1:?usage: run_dispatch.sh OUTDIR}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh "$OUT"
git log -1 --format=%h > "$OUT/commit.txt" 2>/dev/null
BUILT=$(mktemp -d)
python3 -m attnforge build --target sm90 --backend cute_sm90 --dtype bf16 --head-dim 128 --causal true --out "$BUILT" \
  > "$OUT/build.log" 2>&1
for label in selfcheck no-selfcheck; do
  cache=$(mktemp -d); cp -r "$BUILT/." "$cache"
  env ATTNFORGE_CACHE_DIR="$cache" TRITON_CACHE_DIR="$cache/jit" \
    $([ $label = no-selfcheck ] && echo ATTNFORGE_SELFCHECK=0) python3 benchmarks/first_call.py "$label" 2>&1 \
    | tail -n 1 | tee -a "$OUT/first_call.log"
done
python3 benchmarks/startup.py --repeats "${REPEATS:-2}" --json "$OUT/startup.json" > "$OUT/startup.log" 2>&1
tail -n 25 "$OUT/startup.log"
if [ -n "${SWEEP:-}" ]; then
  python3 benchmarks/sweep_cute_sm90.py --head-dim 64 --seqlen 512,1024,4096,16384 --causal causal \
    --match "128x128 s2,192x128 s2" --variants tma_store,tma_store+persistent+persistent_causal \
    --json "$OUT/sweep_persistent_causal.json" 2>&1 | tee "$OUT/sweep.log" | grep TFLOP
fi
python3 benchmarks/dispatch_check.py --set all --json "$OUT/dispatch_check.json" > "$OUT/dispatch_check.log" 2>&1
grep "auto=\|worst" "$OUT/dispatch_check.log" | cut -c1-150
