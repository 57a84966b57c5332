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
    # (ran at 74d76ba^, before the tail split: waves_before*.json)
    python3 benchmarks/wave_probe.py --kind fp8 --head-dim 128 --json $OUT/waves_fp8_d128.json 2>&1 | grep -v Warning
    python3 benchmarks/wave_probe.py --kind fp8 --head-dim 128 --json $OUT/waves_fp8_d128_again.json 2>&1 | grep -v Warning
    ;;
  split)  # the tail split: its A/B on the wave probe's shapes, then the GPU tests of the kernels and the API
    python3 benchmarks/wave_probe.py --kind fp8 --head-dim 128 --json $OUT/split_waves.json 2>&1 | grep -v Warning
    timeout 420 python3 -m pytest tests/backends/cute_sm90/test_gpu.py tests/test_api.py -q -p no:cacheprovider \
      -k "cute_sm90 or fp8 or cuda" 2>&1 | tail -n 15
    ;;
  cudnn)  # carry .gpu-cudnn: FP8 d=128 beside cuDNN's FP8, same run, twice
    python3 benchmarks/bench_fp8.py --head-dim 128 --seqlen 16384,4096 --json $OUT/fp8.json 2>&1 | grep -v Warning
    python3 benchmarks/bench_fp8.py --head-dim 128 --seqlen 16384 --json $OUT/fp8_second.json 2>&1 | grep -v Warning
    ;;
  api)  # test_api's CUDA cases in one process (the split step saw test_large_magnitude_scores...[cuda-fp32-sdpa]
    # fail once after test_gpu.py; it passed alone), then the tail-split GPU tests again
    timeout 500 python3 -m pytest tests/test_api.py tests/backends/cute_sm90/test_gpu.py -q -p no:cacheprovider \
      -k "cuda or tail_split" 2>&1 | tail -n 8
    ;;
  ab)  # carry .gpu-cudnn: interleaved rounds beside cuDNN's FP8 (benchmarks/ab_fp8.py)
    python3 benchmarks/ab_fp8.py --head-dim 128 --seqlen 16384 --rounds 9 --json $OUT/ab_16k.json 2>&1 | grep -v Warning
    python3 benchmarks/ab_fp8.py --head-dim 128 --seqlen 16384 --rounds 5 --causal --json $OUT/ab_16k_causal.json 2>&1 | grep -v Warning
    python3 benchmarks/ab_fp8.py --head-dim 128 --seqlen 4096 --rounds 5 --json $OUT/ab_4k.json 2>&1 | grep -v Warning
    ;;
  pieces4k)  # the plan's threshold at N=4k (tail of 88 tiles, 43 key blocks: the plan keeps tiles whole)
    python3 benchmarks/wave_probe.py --kind fp8 --head-dim 128 --shapes 4:16:4096,1:16:16384,4:16:4032 \
      --pieces auto,1,2,3,4 --json $OUT/pieces.json 2>&1 | grep -v Warning
    python3 benchmarks/wave_probe.py --kind fp8 --head-dim 128 --shapes 4:16:4096,1:16:16384 \
      --pieces 3,1,2,auto --json $OUT/pieces_again.json 2>&1 | grep -v Warning
    ;;
  final)  # the final tree: launch cost (tiny bf16 problem, beside SDPA), then the GPU suite
    python3 benchmarks/launch_cost.py --json $OUT/launch_cost.json 2>&1 | grep -v Warning
    python3 benchmarks/peak_memory.py --json $OUT/peak_memory.json 2>&1 | grep -v Warning
    timeout 420 python3 -m pytest tests/backends/cute_sm90 tests/test_api.py -q -p no:cacheprovider \
      -k "cute_sm90 or fp8 or cuda" 2>&1 | tail -n 6
    ;;
  launch)  # after trimming forward()'s launch path (one cached lookup, run_kernel's plain branch): launch cost
    # twice, then the API's CUDA cases and the FP8 / tail-split kernel tests
    python3 benchmarks/launch_cost.py --json $OUT/launch_cost_trimmed.json 2>&1 | grep -v Warning
    python3 benchmarks/launch_cost.py --json $OUT/launch_cost_trimmed_again.json 2>&1 | grep -v Warning
    timeout 240 python3 -m pytest tests/test_api.py tests/backends/cute_sm90/test_gpu.py tests/backends/cute_sm90/test_tail_split.py \
      tests/backends/cute_sm90/test_v_layout.py -q -p no:cacheprovider -k "cuda or fp8 or tail_split or interpreter" 2>&1 | tail -n 4
    ;;
esac
