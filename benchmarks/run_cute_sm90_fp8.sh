#!/usr/bin/env bash
# cute_sm90 on the lent H200, in two calls while the machine stays warm (.gpu and .gpu-cudnn do not
# fit one copy: ../shared/device/gpu-bundle.sh --peers --cudnn builds both):
#   1. carry .gpu:        bash benchmarks/run_cute_sm90_fp8.sh OUTDIR tests   (GPU tests, launch cost)
#   2. carry .gpu-cudnn:  bash benchmarks/run_cute_sm90_fp8.sh OUTDIR fp8     (FP8 side by side with cuDNN;
#      the CuTe DSL the first call installed in /tmp/site is still there)
set -uo pipefail
out=${1:?usage: bash benchmarks/run_cute_sm90_fp8.sh OUTDIR tests|fp8}; mkdir -p "$out"
for s in .gpu/setup.sh .gpu-cudnn/setup.sh; do [ -f $s ] && source $s; done
mkdir -p /tmp/af && ln -sfn "$PWD" /tmp/af/attnforge
export PYTHONPATH=/tmp/af:$PYTHONPATH TRITON_DEFAULT_FP_FUSION=1 PYTHONUNBUFFERED=1
if [ "${2:-tests}" = tests ]; then
  echo "=== tests" | tee "$out/log.txt"
  python3 -m pytest tests/backends/cute_sm90 -q -p no:cacheprovider 2>&1 | tail -n 12 | tee -a "$out/log.txt"
  echo "=== fp8 errors" | tee -a "$out/log.txt"
  python3 benchmarks/fp8_errors.py 2>&1 | grep -v Warning | tee -a "$out/log.txt"
  echo "=== launch cost" | tee -a "$out/log.txt"
  python3 benchmarks/launch_cost.py --json "$out/launch_cost.json" 2>&1 | grep -v Warning | tee -a "$out/log.txt"
else
  echo "=== fp8" | tee "$out/log-fp8.txt"
  python3 benchmarks/bench_fp8.py --json "$out/fp8.json" 2>&1 | grep -v Warning | tee -a "$out/log-fp8.txt"
fi
