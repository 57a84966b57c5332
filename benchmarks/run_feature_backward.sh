#!/usr/bin/env bash
# cute_sm90's SOFTCAP/ALIBI (and WINDOW) backward on the lent H100/H200 in one call: its GPU tests
# (tests/backends/cute_sm90/test_gpu_features.py, forced backward cases, one process per head dim in parallel; with
# 256 among them also test_gpu_varlen.py's d=256 cases, the packed form), then softcapped training (softcap 30, bf16,
# BENCH_HEAD_DIM, 2048 / BENCH_HEAD_DIM heads, 4k and 16k tokens per sequence, causal and not) and windowed training
# (4096 keys left, causal, one 32k sequence) with each backend forced beside automatic dispatch and FlashAttention-4.
# The head-dim-256 kernel's feature forms are served in the benchmarks' process whatever
# bwd_variants.SPLIT_HEAD_DIM_FEATURES_SERVED says (the tests serve them too).
# FLAT=1 instead: the same backwards on the flat_dq tiles (test_gpu_features.py's flat_dq cases, what
# bwd_variants.FLAT_DQ_FEATURES_SERVED waits for), then the softcapped and windowed training of cute_sm90 forced, in
# alternating processes with that flag off and on (FLAT_ROUNDS each), the tiled and the flat dQ path on the same calls.
# Usage: [HEAD_DIMS="64 128"] [BENCH_HEAD_DIM=128] [FLAT=1] benchmarks/run_feature_backward.sh OUTDIR
#   e.g. HEAD_DIMS="256 192" BENCH_HEAD_DIM=256 for the head-dim-256 kernel's feature forms; HEAD_DIMS="" runs no
#   test (the training benchmarks only)
set -uo pipefail
OUT=${1:?usage: run_feature_backward.sh OUTDIR}
HEAD_DIMS=${HEAD_DIMS-64 128}  # (set but empty: no tests)
BENCH_HEAD_DIM=${BENCH_HEAD_DIM:-128}
mkdir -p "$OUT/logs"
source benchmarks/gpu_env.sh "$OUT"
run_tests() {  # run_tests LOGNAME FILE -k EXPR
  local log=$1 file=$2; shift 2
  (cd /tmp && timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -c "$OLDPWD/tests/pytest.ini" \
     "$OLDPWD/tests/backends/cute_sm90/$file" "$@") > "$OUT/logs/$log.log" 2>&1
}
FLAT=${FLAT:-0}
TESTS_K=$([[ $FLAT == 1 ]] && echo "flat_dq and not split_loops" || echo "forced and not flat_dq and not split_loops")
for d in $HEAD_DIMS; do
  run_tests "d$d" test_gpu_features.py -k "$TESTS_K and -$d]" &
done
if [[ $FLAT != 1 && " $HEAD_DIMS " == *" 256 "* ]]; then
  run_tests varlen-d256 test_gpu_varlen.py -k "d256" &
fi
wait
for f in "$OUT"/logs/*.log; do echo "== $f"; grep -v "Warning\|range_constexpr\|^  /tmp\|^$" "$f" | tail -n 30; done \
  > "$OUT/feature-tests.log"
rm -rf "$OUT/logs"
if [[ $FLAT == 1 ]]; then
  FLAT_BENCH='import sys
from attnforge.backends.cute_sm90 import bwd_variants
bwd_variants.FLAT_DQ_FEATURES_SERVED = sys.argv.pop(1) == "1"
from attnforge.cli import main
sys.exit(main(sys.argv[1:]))'
  for round in $(seq "${FLAT_ROUNDS:-2}"); do
    for flag in 0 1; do
      timeout "${BENCH_TIMEOUT:-240}" python3 -c "$FLAT_BENCH" $flag bench --seqlen 4096,16384 --head-dim "$BENCH_HEAD_DIM" \
        --causal both --mode fwd+bwd --softcap 30 --backends cute_sm90 --out "$OUT/softcap-flat$flag-r$round.json" \
        > "$OUT/softcap-flat$flag-r$round.log" 2>&1
      timeout "${BENCH_TIMEOUT:-240}" python3 -c "$FLAT_BENCH" $flag bench --seqlen 32768 --tokens 32768 \
        --head-dim "$BENCH_HEAD_DIM" --heads $((2048 / BENCH_HEAD_DIM)) --causal true --window-size 4096,0 \
        --mode fwd+bwd --backends cute_sm90 --out "$OUT/window-flat$flag-r$round.json" \
        > "$OUT/window-flat$flag-r$round.log" 2>&1
    done
  done
  tail -n 6 "$OUT/feature-tests.log"; grep -h "cute_sm90" "$OUT"/*-flat*.log | tail -n 40
  exit 0
fi
# `attnforge bench` with the head-dim-256 kernel's feature forms served (a program text, not a shell function:
# timeout runs commands only)
SERVED_BENCH='import sys
from attnforge.backends.cute_sm90 import bwd_variants
bwd_variants.SPLIT_HEAD_DIM_FEATURES_SERVED = True
from attnforge.cli import main
sys.exit(main(sys.argv[1:]))'
timeout "${BENCH_TIMEOUT:-240}" python3 -c "$SERVED_BENCH" bench --seqlen 4096,16384 --head-dim "$BENCH_HEAD_DIM" \
  --causal both --mode fwd+bwd --softcap 30 --backends auto,triton_fa2,cute_sm90,fa4 --out "$OUT/softcap-train.json" \
  > "$OUT/softcap-train.log" 2>&1
timeout "${BENCH_TIMEOUT:-240}" python3 -c "$SERVED_BENCH" bench --seqlen 32768 --tokens 32768 \
  --head-dim "$BENCH_HEAD_DIM" --heads $((2048 / BENCH_HEAD_DIM)) --causal true --window-size 4096,0 --mode fwd+bwd \
  --backends auto,triton_fa2,cute_sm90,fa4 --out "$OUT/window-train.json" > "$OUT/window-train.log" 2>&1
tail -n 6 "$OUT/feature-tests.log"; grep -v "Warning\|exe_args" "$OUT/softcap-train.log" "$OUT/window-train.log" | tail -n 40
