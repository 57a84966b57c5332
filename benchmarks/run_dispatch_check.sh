#!/usr/bin/env bash
# attnforge's automatic choice against every backend forced and stock SDPA, with the cost table as checked out:
# benchmarks/dispatch_check.py --set all (its JSON written after every row). Usage: benchmarks/run_dispatch_check.sh OUTDIR
set -uo pipefail
OUT=${1:?usage: run_dispatch_check.sh OUTDIR}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh "$OUT"
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv > "$OUT/device.txt" 2>&1
python3 benchmarks/dispatch_check.py --set all --json "$OUT/dispatch_check.json" > "$OUT/dispatch_check.log" 2>&1
grep "auto=\|worst" "$OUT/dispatch_check.log" | cut -c1-150
