#!/usr/bin/env bash
# Packed (varlen) batches on the lent GPU: the tests of the VARLEN kernels on the GPU, then
# benchmarks/bench_varlen.py beside the dense kernel and FlashAttention-4. Usage: benchmarks/run_varlen.sh OUTDIR
set -uo pipefail
OUT=${1:?usage: run_varlen.sh OUTDIR}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh "$OUT"
(cd /tmp && python3 -m pytest -q -p no:cacheprovider -c "$OLDPWD/tests/pytest.ini" \
  "$OLDPWD/tests/backends/triton_fa2/test_varlen_gpu.py") 2>&1 | tail -25 | tee "$OUT/tests.log"
python3 benchmarks/bench_varlen.py --json "$OUT/varlen.json" 2>&1 | tee "$OUT/bench.log"
