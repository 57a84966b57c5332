#!/usr/bin/env bash
# cute_sm90 on the lent H200 in one call: GPU tests (poisoned outputs, the API matrix), the tile
# sweep, the side-by-side bench (forward; cute_sm90, triton_fa2, SDPA flash/cuDNN, FA4) and the
# tiny-problem launch cost. Needs .gpu (../shared/device/gpu-bundle.sh --peers) carried along.
#   bash benchmarks/run_cute_sm90.sh OUTDIR [sweep|nosweep]
set -uo pipefail
out=${1:?usage: bash benchmarks/run_cute_sm90.sh OUTDIR}; mkdir -p "$out"
source .gpu/setup.sh
mkdir -p /tmp/af && ln -sfn "$PWD" /tmp/af/attnforge
export PYTHONPATH=/tmp/af:$PYTHONPATH TRITON_DEFAULT_FP_FUSION=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$out/log.txt"
echo "=== tests" | tee -a "$out/log.txt"
python3 -m pytest tests/backends/cute_sm90 tests/test_api.py -q -p no:cacheprovider -k "cute_sm90 or cuda" -x 2>&1 | tail -n 15 | tee -a "$out/log.txt"
if [ "${2:-sweep}" = sweep ]; then
  echo "=== sweep" | tee -a "$out/log.txt"
  python3 benchmarks/sweep_cute_sm90.py --json "$out/sweep.json" 2>&1 | grep -v Warning | tee -a "$out/log.txt"
fi
echo "=== launch cost" | tee -a "$out/log.txt"
python3 benchmarks/launch_cost.py --json "$out/launch_cost.json" 2>&1 | grep -v Warning | tee -a "$out/log.txt"
echo "=== bench" | tee -a "$out/log.txt"
python3 -m attnforge bench --mode fwd --head-dim 64,128,256 --seqlen 1024,4096,16384 \
  --backends cute_sm90,triton_fa2,sdpa-flash,sdpa-cudnn,fa4 --out "$out/bench.json" 2>&1 | grep -v Warning | tee "$out/bench.txt"
