#!/usr/bin/env bash
# Session 5 device runs: bash benchmarks/results/2026-11-29-h200-cute_sm90-session5/run.sh STEP
# (carry .gpu, or .gpu-cudnn for step cudnn; writes into $OUT). Each step is one device call. Steps poly
# and pin_fp8 ran with the knobs of template_experiments.jinja.txt / variants_experiments.py.txt (and the
# sweep's candidates and --also-pinned of that moment), which are not in the package.
# (Step persist ran with --also-persistent, since replaced by its equivalent --variants base,persistent.)
set -uo pipefail
for f in .gpu/setup.sh .gpu-cudnn/setup.sh; do [ -f $f ] && source $f; done
mkdir -p /tmp/af && ln -sfn "$PWD" /tmp/af/attnforge
export PYTHONPATH=/tmp/site:/tmp/af:$PYTHONPATH TRITON_DEFAULT_FP_FUSION=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
case "$1" in
  poly)  # FP8 d=128: exp2 of one in N columns on the FMA pipe, against the shipped tile, same run
    python3 benchmarks/sweep_cute_sm90.py --kind fp8 --head-dim 128 --seqlen 16384,4096 --causal both \
      --match "=128x128 s2 2 consumer warpgroups pingpong,exp2 poly,=192x96 s2 3 consumer warpgroups pingpong" \
      --json $OUT/poly_sweep.json 2>&1 | grep -v Warning
    # 16-bit d=64 now picks 192x128 with 3 warpgroups: its GPU tests, and the negative-scale rows
    python3 -m pytest tests/backends/cute_sm90/test_gpu.py tests/test_api.py -q -p no:cacheprovider -x \
      -k "(test_poisoned_outputs_match_fp64 and 64) or negative_scale or fp8" 2>&1 | tail -n 8
    ;;
  pin_fp8)  # K released after the softmax so that ptxas cannot hoist the P V wait into it
    python3 benchmarks/sweep_cute_sm90.py --kind fp8 --head-dim 128,64,256 --seqlen 16384,4096 --causal both --also-pinned \
      --match "=128x128 s2 2 consumer warpgroups pingpong,=192x96 s2 3 consumer warpgroups pingpong,=192x128 s2 3 consumer warpgroups pingpong" \
      --json $OUT/pin_fp8.json 2>&1 | grep -v Warning
    ;;
  pin_16bit)
    python3 benchmarks/sweep_cute_sm90.py --kind 16bit --head-dim 128,64,256 --seqlen 16384,4096 --causal both --also-pinned \
      --match "=128x128 s2 2 consumer warpgroups pingpong,=192x128 s2 3 consumer warpgroups pingpong,=128x64 s2 2 consumer warpgroups pingpong" \
      --json $OUT/pin_16bit.json 2>&1 | grep -v Warning
    ;;
  nopp)  # FA3 runs FP8 without its scheduler barrier (pingpong): tiles without it, 192x96 with 3 stages
    python3 benchmarks/sweep_cute_sm90.py --kind fp8 --head-dim 128 --seqlen 16384,4096 --causal both \
      --match "=128x128 s2 2 consumer warpgroups pingpong,=128x128 s2 2 consumer warpgroups,=128x224 s2 2 consumer warpgroups,=128x192 s2 2 consumer warpgroups,=192x96 s2 3 consumer warpgroups pingpong,=192x96 s2 3 consumer warpgroups,=192x96 s3 3 consumer warpgroups pingpong" \
      --json $OUT/nopp.json 2>&1 | grep -v "Warning\|exp2 poly"
    ;;
  side)  # clocks and power under load; the side-by-side forward bench with the peers; launch cost
    python3 benchmarks/clock_probe.py --seconds 3 --json $OUT/clock.json 2>&1 | grep -v Warning
    python3 -m attnforge bench --mode fwd --head-dim 64,128,256 --seqlen 1024,4096,16384 \
      --backends cute_sm90,triton_fa2,sdpa-flash,sdpa-cudnn,fa4 --out $OUT/bench.json 2>&1 | grep -v Warning
    python3 benchmarks/launch_cost.py --json $OUT/launch_cost.json 2>&1 | grep -v Warning
    ;;
  cudnn)  # carry .gpu-cudnn (the CuTe DSL from an earlier call is still in /tmp/site): FP8 beside cuDNN
    python3 benchmarks/clock_probe.py --seconds 3 --json $OUT/clock_cudnn.json 2>&1 | grep -v Warning
    python3 benchmarks/bench_fp8.py --head-dim 128,64,256 --seqlen 16384,4096 --json $OUT/fp8.json 2>&1 | grep -v Warning
    ;;
  persist)  # the picks with and without the persistent tile loop (non-causal only), N 1k/4k/16k
    m="=128x128 s2 2 consumer warpgroups pingpong,=192x128 s2 3 consumer warpgroups pingpong,=128x64 s2 2 consumer warpgroups pingpong"
    python3 benchmarks/sweep_cute_sm90.py --kind 16bit --head-dim 128,64,256 --seqlen 1024,4096,16384 --causal full \
      --variants base,persistent --match "$m" --json $OUT/persist_16bit.json 2>&1 | grep -v Warning
    python3 benchmarks/sweep_cute_sm90.py --kind fp8 --head-dim 128,64,256 --seqlen 1024,4096,16384 --causal full \
      --variants base,persistent --match "$m" --json $OUT/persist_fp8.json 2>&1 | grep -v Warning
    ;;
  tests)  # the GPU suite on the picked kernels
    python3 -m pytest tests/backends/cute_sm90 tests/test_api.py -q -p no:cacheprovider -x \
      -k "cute_sm90 or fp8 or cuda" 2>&1 | tail -n 12
    ;;
  final)  # carry .gpu-cudnn on a machine where .gpu's stack is in /tmp/site: after the tile-loop change
    python3 benchmarks/bench_fp8.py --head-dim 128 --seqlen 16384,4096 --json $OUT/final_fp8.json 2>&1 | grep -v Warning
    python3 -m attnforge bench --mode fwd --head-dim 128,64 --seqlen 1024,4096,16384 \
      --backends cute_sm90,sdpa-cudnn,fa4 --out $OUT/final_bench.json 2>&1 | grep -v Warning | grep -v "^$"
    ;;
esac
