#!/usr/bin/env bash
# Packed (varlen) batches on the lent GPU: the tests of the VARLEN kernels on the GPU (triton_fa2's, and on sm90
# cute_sm90's packed forward, one process per head dim: the compiles are CPU-bound), then benchmarks/bench_varlen.py
# beside the dense kernel and FlashAttention-4. Usage: benchmarks/run_varlen.sh OUTDIR [bench_varlen.py arguments]
set -uo pipefail
OUT=${1:?usage: run_varlen.sh OUTDIR [bench arguments]}
shift
mkdir -p "$OUT"
source benchmarks/gpu_env.sh "$OUT"
if [ -z "${SKIP_TESTS:-}" ]; then
  run_tests() {  # FILE [-k EXPR]: one pytest process, its tail into $OUT
    local name; name=$(basename "$1" .py)${3:+-$3}
    (cd /tmp && python3 -m pytest -q -p no:cacheprovider -c "$OLDPWD/tests/pytest.ini" "$OLDPWD/$1" ${2:+"$2"} ${3:+"$3"}) \
      > "$OUT/$name.log" 2>&1
  }
  run_tests tests/backends/triton_fa2/test_varlen_gpu.py &
  for d in _d8 _d64 _d96 bf16_d128 _d192 _d256 fp16 dispatch; do
    run_tests tests/backends/cute_sm90/test_gpu_varlen.py -k "$d" &
  done
  wait
  tail -n 3 "$OUT"/*.log | tee "$OUT/tests.log"
fi
python3 benchmarks/bench_varlen.py --json "$OUT/varlen.json" "$@" 2>&1 | tee "$OUT/bench.log"
