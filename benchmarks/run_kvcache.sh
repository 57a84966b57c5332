#!/usr/bin/env bash
# Attention against a KV cache on the lent GPU: the tests of triton_fa2's KV-cache kernel on the GPU, then
# benchmarks/bench_kvcache.py (decode; SWEEP=1: with its tile and split sweep), then cute_sm90's KV-cache kernels'
# GPU tests and benchmarks/bench_kvcache_prefill.py (chunked prefill). Usage: benchmarks/run_kvcache.sh OUTDIR
set -uo pipefail
OUT=${1:?usage: run_kvcache.sh OUTDIR}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh "$OUT"
(cd /tmp && python3 -m pytest -q -p no:cacheprovider -c "$OLDPWD/tests/pytest.ini" \
  "$OLDPWD/tests/backends/triton_fa2/test_kvcache_gpu.py") 2>&1 | tail -25 | tee "$OUT/tests.log"
python3 benchmarks/bench_kvcache.py --json "$OUT/kvcache.json" ${SWEEP:+--sweep} 2>&1 | tee "$OUT/bench.log"
# cute_sm90's KV-cache kernels (chunked prefill): their GPU tests, then beside triton_fa2's, the dense kernel and FA4
(cd /tmp && python3 -m pytest -q -p no:cacheprovider -c "$OLDPWD/tests/pytest.ini" \
  "$OLDPWD/tests/backends/cute_sm90/test_gpu_kvcache.py") 2>&1 | tail -25 | tee "$OUT/tests_cute.log"
python3 benchmarks/bench_kvcache_prefill.py --json "$OUT/prefill.json" 2>&1 | tee "$OUT/prefill.log"
