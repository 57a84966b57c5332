#!/usr/bin/env bash
# The sm90 cost table measured afresh in parts that each fit one 10-minute device call, and the automatic choice
# checked with it against every backend forced and stock SDPA (benchmarks/dispatch_check.py --set all, its JSON
# written after every row). Every tune part measures bench/costs.py MODEL_SHAPES too.
#   PART=a:      attnforge tune --costs --head-dim 64,128,256 -> OUTDIR/costs-a.json
#   PART=b:      attnforge tune --costs --head-dim 80,96,192  -> OUTDIR/costs-b.json, merged after TABLE_A (part a's
#                table, carried in the checkout) into OUTDIR/sm90.json
#   PART=models: attnforge tune --costs --models-only, merged ahead of the checked-out dispatch/costs/sm90.json into
#                OUTDIR/sm90.json
#   PART=dims:   attnforge tune --costs --head-dim DIMS (e.g. 256, after a kernel there changed), merged the same way
#   PART=check:  TABLE (default: the checked-out dispatch/costs/sm90.json) installed, then the check
# Usage: PART=a|b|models|dims|check [TABLE_A=path] [DIMS=list] [TABLE=path] benchmarks/run_retune.sh OUTDIR
set -uo pipefail
OUT=${1:?usage: PART=a|b|models|dims|check run_retune.sh OUTDIR}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh "$OUT"
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv > "$OUT/device.txt" 2>&1
case "${PART:?PART=a, b, models, dims or check}" in
  a)
    python3 -m attnforge tune --costs --head-dim 64,128,256 --out "$OUT/costs-a.json" 2> "$OUT/tune-a.log"
    tail -n 3 "$OUT/tune-a.log" | cut -c1-200 ;;
  b)
    python3 -m attnforge tune --costs --head-dim 80,96,192 --out "$OUT/costs-b.json" 2> "$OUT/tune-b.log"
    tail -n 2 "$OUT/tune-b.log" | cut -c1-200
    python3 -m attnforge tune --costs --merge "${TABLE_A:?}" "$OUT/costs-b.json" --out "$OUT/sm90.json" ;;
  models)
    python3 -m attnforge tune --costs --models-only --out "$OUT/costs-models.json" 2> "$OUT/tune-models.log"
    tail -n 5 "$OUT/tune-models.log" | cut -c1-250
    python3 -m attnforge tune --costs --merge "$OUT/costs-models.json" dispatch/costs/sm90.json --out "$OUT/sm90.json" ;;
  dims)
    python3 -m attnforge tune --costs --head-dim "${DIMS:?}" --out "$OUT/costs-dims.json" 2> "$OUT/tune-dims.log"
    tail -n 3 "$OUT/tune-dims.log" | cut -c1-200
    python3 -m attnforge tune --costs --merge "$OUT/costs-dims.json" dispatch/costs/sm90.json --out "$OUT/sm90.json" ;;
  check)
    if [ -n "${TABLE:-}" ]; then cp "$TABLE" dispatch/costs/sm90.json; fi
    bash benchmarks/run_dispatch_check.sh "$OUT" ;;
esac
