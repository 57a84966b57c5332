#!/usr/bin/env bash
# Session 7 device runs: bash benchmarks/results/2026-11-29-h200-cute_sm90-session7/run.sh STEP
# (carry .gpu, or .gpu-cudnn for the steps beside cuDNN on a machine that ran a .gpu step; writes into $OUT).
set -uo pipefail
for f in .gpu/setup.sh .gpu-cudnn/setup.sh; do [ -f $f ] && source $f; done
mkdir -p /tmp/af && ln -sfn "$PWD" /tmp/af/attnforge
export PYTHONPATH=/tmp/site:/tmp/af:$PYTHONPATH TRITON_DEFAULT_FP_FUSION=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
case "$1" in
  waves)  # wave quantization of the FP8 d=128 pick (192-row tiles): whole waves vs a part-filled last wave
    python3 benchmarks/wave_probe.py --kind fp8 --head-dim 128 --json $OUT/waves_fp8_d128.json 2>&1 | grep -v Warning
    python3 benchmarks/wave_probe.py --kind fp8 --head-dim 128 --json $OUT/waves_fp8_d128_again.json 2>&1 | grep -v Warning
    ;;
esac
