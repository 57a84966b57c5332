#!/usr/bin/env bash
# cute_sm90's packed (varlen) backward on the lent H100/H200, in one call: the per-batch probe (a fault ends one
# process and compute-sanitizer names the instruction), the GPU tests that serve it (test_gpu_varlen.py at head dims
# 64 and 128, windows, dispatch), then bench_varlen.py's training rows (its two "cute_sm90 fwd + ... bwd" rows time
# both backwards after the same packed forward) beside the dense kernel and FlashAttention-4.
# Usage: benchmarks/run_varlen_backward.sh OUTDIR [bench_varlen.py arguments]; writes OUTDIR/{probe,tests,bench}.log,
# OUTDIR/probe/summary.txt and OUTDIR/varlen.json.
set -uo pipefail
OUT=${1:?usage: run_varlen_backward.sh OUTDIR [bench arguments]}
shift
mkdir -p "$OUT/probe" "$OUT/logs"
source benchmarks/gpu_env.sh "$OUT"
ATTNFORGE_SELFCHECK=0 timeout 300 python3 benchmarks/probe_varlen_backward.py "$OUT/probe" --head-dim 128,64 \
  > "$OUT/probe.log" 2>&1 &
for k in "bf16_d64 and not window" "bf16_d128 and not window" "fp16_d128 and not window" window dispatch; do
  (cd /tmp && timeout 420 python3 -m pytest -q -p no:cacheprovider -c "$OLDPWD/tests/pytest.ini" \
     "$OLDPWD/tests/backends/cute_sm90/test_gpu_varlen.py" -k "$k") > "$OUT/logs/${k// /_}.log" 2>&1 &
done
wait
for f in "$OUT"/logs/*.log; do echo "== $f"; tail -n 25 "$f"; done > "$OUT/tests.log"
rm -rf "$OUT/logs"
timeout "${BENCH_TIMEOUT:-240}" python3 benchmarks/bench_varlen.py --json "$OUT/varlen.json" "$@" > "$OUT/bench.log" 2>&1
tail -n 4 "$OUT/tests.log" "$OUT/probe/summary.txt"; cat "$OUT/bench.log" | tail -n 30
