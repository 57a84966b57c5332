#!/usr/bin/env bash
# Decode against a KV cache on the lent GPU: the tests of the KV-cache kernel on the GPU, then
# benchmarks/bench_kvcache.py (with its tile and split sweep). Usage: benchmarks/run_kvcache.sh OUTDIR
set -uo pipefail
OUT=${1:?usage: run_kvcache.sh OUTDIR}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh "$OUT"
(cd /tmp && python3 -m pytest -q -p no:cacheprovider -c "$OLDPWD/tests/pytest.ini" \
  "$OLDPWD/tests/backends/triton_fa2/test_kvcache_gpu.py") 2>&1 | tail -25 | tee "$OUT/tests.log"
python3 benchmarks/bench_kvcache.py --json "$OUT/kvcache.json" ${SWEEP:+--sweep} 2>&1 | tee "$OUT/bench.log"
