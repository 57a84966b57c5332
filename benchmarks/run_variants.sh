#!/usr/bin/env bash
# Attention variants on the lent GPU: triton_fa2's and cute_sm90's feature kernels against fp64 math
# (tests/backends/triton_fa2/test_variants_gpu.py, tests/backends/cute_sm90/test_gpu_features.py), then the sliding-window and softcap timings of the variants
# issue beside the dense kernel and FlashAttention-4 in one run: N=32k causal with a 4096-key window (TFLOP/s count
# visible pairs) and the softcapped forward, bf16, d=128, 16 heads. Usage: benchmarks/run_variants.sh OUTDIR
set -uo pipefail
OUT=${1:?usage: run_variants.sh OUTDIR}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh "$OUT"
if [ -z "${SKIP_TESTS:-}" ]; then
  (cd /tmp && python3 -m pytest -q -p no:cacheprovider -c "$OLDPWD/tests/pytest.ini" \
    "$OLDPWD/tests/backends/triton_fa2/test_variants_gpu.py" "$OLDPWD/tests/backends/cute_sm90/test_gpu_features.py") 2>&1 | tail -25 | tee "$OUT/variants-tests.log"
fi
common=(--seqlen 32768 --tokens 32768 --head-dim 128 --heads 16 --causal true --mode fwd,fwd+bwd)
backends=auto,triton_fa2,cute_sm90,fa4
{ echo "=== dense"; python3 -m attnforge bench "${common[@]}" --backends $backends --out "$OUT/dense.json"
  echo "=== window 4096"; python3 -m attnforge bench "${common[@]}" --window-size 4096,0 --backends $backends \
    --out "$OUT/window.json"
  echo "=== softcap 30"; python3 -m attnforge bench --seqlen 4096,16384 --head-dim 128 --causal both --mode fwd \
    --softcap 30 --backends $backends --out "$OUT/softcap.json"
  echo "=== dense (softcap's shapes)"; python3 -m attnforge bench --seqlen 4096,16384 --head-dim 128 --causal both \
    --mode fwd --backends $backends --out "$OUT/dense-fwd.json"
} 2>&1 | tee "$OUT/variants-bench.log"
