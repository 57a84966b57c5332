#!/usr/bin/env bash
# Start-up and short problems on the lent GPU, one after another (no timing beside a compile): cute_sm90 kernels
# loaded from their shared libraries against fp64 math (tests/backends/cute_sm90/test_gpu_shared.py), the first
# call of a fresh process per configuration (benchmarks/startup.py), then cute_sm90's d=64 tiles at short
# sequences (benchmarks/sweep_cute_sm90.py: 32 x 512 and 16 x 1024 at 32 heads).
# Usage: benchmarks/run_start.sh OUTDIR
set -uo pipefail
OUT=${1:?usage: run_start.sh OUTDIR}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh "$OUT"
{ command -v cc gcc; nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv; } > "$OUT/host.log" 2>&1
(cd /tmp && python3 -m pytest -q -p no:cacheprovider -c "$OLDPWD/tests/pytest.ini" \
  "$OLDPWD/tests/backends/cute_sm90/test_gpu_shared.py") > "$OUT/test_shared.log" 2>&1
tail -n 3 "$OUT/test_shared.log"
python3 benchmarks/startup.py --repeats 3 --json "$OUT/startup.json" > "$OUT/startup.log" 2>&1
tail -n 30 "$OUT/startup.log"
python3 benchmarks/sweep_cute_sm90.py --head-dim 64 --seqlen 512,1024 --match "128x128 s2,192x128 s2,128x192 s2" \
  --variants tma_store,tma_store+persistent --json "$OUT/sweep_short.json" 2>&1 | tee "$OUT/sweep.log" | tail -n 30
