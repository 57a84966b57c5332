#!/usr/bin/env bash
# cute_sm90's SOFTCAP/ALIBI (and WINDOW) backward on the lent H100/H200 in one call: its GPU tests
# (tests/backends/cute_sm90/test_gpu_features.py, forced backward cases, d=64 and d=128 in parallel), then softcapped
# training (softcap 30, bf16, d=128, 16 heads, 4k and 16k tokens per sequence, causal and not) and windowed training
# (4096 keys left, causal, one 32k sequence) with each backend forced beside automatic dispatch and
# FlashAttention-4. Usage: benchmarks/run_feature_backward.sh OUTDIR
set -uo pipefail
OUT=${1:?usage: run_feature_backward.sh OUTDIR}
mkdir -p "$OUT/logs"
source benchmarks/gpu_env.sh "$OUT"
for d in 64 128; do
  (cd /tmp && timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -c "$OLDPWD/tests/pytest.ini" \
     "$OLDPWD/tests/backends/cute_sm90/test_gpu_features.py" -k "forced and -$d]") > "$OUT/logs/d$d.log" 2>&1 &
done
wait
for f in "$OUT"/logs/*.log; do echo "== $f"; grep -v "Warning\|range_constexpr\|^  /tmp\|^$" "$f" | tail -n 30; done \
  > "$OUT/feature-tests.log"
rm -rf "$OUT/logs"
timeout "${BENCH_TIMEOUT:-240}" python3 -m attnforge bench --seqlen 4096,16384 --head-dim 128 --causal both \
  --mode fwd+bwd --softcap 30 --backends auto,triton_fa2,cute_sm90,fa4 --out "$OUT/softcap-train.json" \
  > "$OUT/softcap-train.log" 2>&1
timeout "${BENCH_TIMEOUT:-240}" python3 -m attnforge bench --seqlen 32768 --tokens 32768 --head-dim 128 --heads 16 \
  --causal true --window-size 4096,0 --mode fwd+bwd --backends auto,triton_fa2,cute_sm90,fa4 \
  --out "$OUT/window-train.json" > "$OUT/window-train.log" 2>&1
tail -n 6 "$OUT/feature-tests.log"; grep -v "Warning\|exe_args" "$OUT/softcap-train.log" "$OUT/window-train.log" | tail -n 40
