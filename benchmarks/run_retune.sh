#!/usr/bin/env bash
# The sm90 cost table measured afresh in two parts (each fits one 10-minute device call), then the automatic
# choice checked against every backend forced and stock SDPA with the merged table in place.
#   PART=a: attnforge tune --costs --head-dim 64,128,256  -> OUTDIR/costs-a.json
#   PART=b: attnforge tune --costs --head-dim 80,96,192   -> OUTDIR/costs-b.json; merged with TABLE_A (part a's
#           table, carried in the checkout) into OUTDIR/sm90.json, installed as dispatch/costs/sm90.json in this
#           checkout, then benchmarks/dispatch_check.py --set all (its JSON written after every row).
#   PART=models: attnforge tune --costs --models-only (bench/costs.py MODEL_SHAPES) -> OUTDIR/costs-models.json, merged
#           ahead of the shipped dispatch/costs/sm90.json into OUTDIR/sm90.json, installed, then the same check.
# Usage: PART=a benchmarks/run_retune.sh OUTDIR;  PART=b TABLE_A=path benchmarks/run_retune.sh OUTDIR
set -uo pipefail
OUT=${1:?usage: PART=a|b|models run_retune.sh OUTDIR}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh "$OUT"
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv > "$OUT/device.txt" 2>&1
check() {
  python3 benchmarks/dispatch_check.py --set all --json "$OUT/dispatch_check.json" > "$OUT/dispatch_check.log" 2>&1
  grep "auto=\|worst" "$OUT/dispatch_check.log" | cut -c1-150
}
case "${PART:?PART=a, b or models}" in
  a)
    python3 -m attnforge tune --costs --head-dim 64,128,256 --out "$OUT/costs-a.json" 2> "$OUT/tune-a.log"
    tail -n 3 "$OUT/tune-a.log" | cut -c1-200 ;;
  b)
    python3 -m attnforge tune --costs --head-dim 80,96,192 --out "$OUT/costs-b.json" 2> "$OUT/tune-b.log"
    tail -n 2 "$OUT/tune-b.log" | cut -c1-200
    python3 -m attnforge tune --costs --merge "${TABLE_A:?}" "$OUT/costs-b.json" --out "$OUT/sm90.json" || exit 1
    cp "$OUT/sm90.json" dispatch/costs/sm90.json
    check ;;
  models)
    python3 -m attnforge tune --costs --models-only --out "$OUT/costs-models.json" 2> "$OUT/tune-models.log"
    tail -n 5 "$OUT/tune-models.log" | cut -c1-250
    python3 -m attnforge tune --costs --merge "$OUT/costs-models.json" dispatch/costs/sm90.json --out "$OUT/sm90.json" \
      || exit 1
    cp "$OUT/sm90.json" dispatch/costs/sm90.json
    check ;;
esac
