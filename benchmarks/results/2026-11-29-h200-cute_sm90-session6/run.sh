#!/usr/bin/env bash
# Session 6 device runs: bash benchmarks/results/2026-11-29-h200-cute_sm90-session6/run.sh STEP
# (carry .gpu, or .gpu-cudnn for the steps beside cuDNN on a machine that ran a .gpu step; writes into $OUT).
set -uo pipefail
for f in .gpu/setup.sh .gpu-cudnn/setup.sh; do [ -f $f ] && source $f; done
mkdir -p /tmp/af && ln -sfn "$PWD" /tmp/af/attnforge
export PYTHONPATH=/tmp/site:/tmp/af:$PYTHONPATH TRITON_DEFAULT_FP_FUSION=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
sweep() { python3 benchmarks/sweep_cute_sm90.py "$@" 2>&1 | grep -v Warning; }
T128="=128x128 s2 2 consumer warpgroups pingpong"
T192_128="=192x128 s2 3 consumer warpgroups pingpong"
T192_96="=192x96 s2 3 consumer warpgroups pingpong"
case "$1" in
  fp8rs)  # FP8: row sums by a WGMMA against ones (row_sum_mma) vs the FADD row sums, every head dim
    sweep --kind fp8 --head-dim 128 --seqlen 16384,4096 --causal both --match "$T128,$T192_96" \
      --variants base,row_sum_mma --json $OUT/fp8rs_d128.json
    sweep --kind fp8 --head-dim 128 --seqlen 16384,4096 --causal full --match "$T128" \
      --variants persistent,persistent+row_sum_mma --json $OUT/fp8rs_d128_persistent.json
    sweep --kind fp8 --head-dim 64 --seqlen 16384,4096 --causal full --match "$T192_128" \
      --variants persistent,persistent+row_sum_mma --json $OUT/fp8rs_d64.json
    sweep --kind fp8 --head-dim 256 --seqlen 16384,4096 --causal both --match "$T128" \
      --variants base,row_sum_mma --json $OUT/fp8rs_d256.json
    ;;
  fp8rs2)  # after the fix (block sums from zero, running sums in fp32 registers): d=128 and d=64 again
    sweep --kind fp8 --head-dim 128 --seqlen 16384,4096 --causal both --match "$T128,$T192_96" \
      --variants base,row_sum_mma --json $OUT/fp8rs2_d128.json
    sweep --kind fp8 --head-dim 128 --seqlen 16384,4096 --causal full --match "$T128,$T192_96" \
      --variants persistent,persistent+row_sum_mma --json $OUT/fp8rs2_d128_persistent.json
    sweep --kind fp8 --head-dim 64 --seqlen 16384,4096 --causal both --match "$T192_128" \
      --variants persistent,persistent+row_sum_mma --json $OUT/fp8rs2_d64.json
    ;;
  fp8rs3)  # FP8 d=128 with row_sum_mma: the picked 192x96 beside its neighbours (pingpong off, 3 stages, 128x192)
    sweep --kind fp8 --head-dim 128 --seqlen 16384,4096 --causal both \
      --match "$T192_96,=192x96 s2 3 consumer warpgroups,=192x96 s3 3 consumer warpgroups pingpong,=128x192 s2 2 consumer warpgroups pingpong,=128x128 s2 2 consumer warpgroups" \
      --variants row_sum_mma --json $OUT/fp8rs3_d128.json
    ;;
  thresh)  # FP8 d=128 and d=64 picks with the conditional rescale (threshold 0.8 in log2 units), same run.
    # Ran with rescale_threshold_experiment.diff applied (slower: not kept in the package).
    sweep --kind fp8 --head-dim 128 --seqlen 16384,4096 --causal both --match "$T192_96" \
      --variants row_sum_mma,row_sum_mma+rescale_threshold=0.8 --json $OUT/thresh_d128.json
    sweep --kind fp8 --head-dim 64 --seqlen 16384,4096 --causal full --match "$T192_128" \
      --variants persistent+row_sum_mma,persistent+row_sum_mma+rescale_threshold=0.8 --json $OUT/thresh_d64.json
    ;;
  b16rs)  # the same for 16-bit (bf16)
    sweep --kind 16bit --head-dim 128 --seqlen 16384,4096 --causal full --match "$T128" \
      --variants persistent,persistent+row_sum_mma --json $OUT/b16rs_d128_persistent.json
    sweep --kind 16bit --head-dim 128 --seqlen 16384,4096 --causal causal --match "$T128" \
      --variants base,row_sum_mma --json $OUT/b16rs_d128_causal.json
    sweep --kind 16bit --head-dim 64 --seqlen 16384,4096 --causal both --match "$T192_128" \
      --variants base,row_sum_mma --json $OUT/b16rs_d64.json
    sweep --kind 16bit --head-dim 256 --seqlen 16384,4096 --causal both --match "=128x64 s2 2 consumer warpgroups pingpong" \
      --variants base,row_sum_mma --json $OUT/b16rs_d256.json
    ;;
  tests)  # the GPU suite on the picked kernels
    python3 -m pytest tests/backends/cute_sm90 tests/test_api.py -q -p no:cacheprovider -x \
      -k "cute_sm90 or fp8 or cuda" 2>&1 | tail -n 12
    ;;
  cudnn)  # carry .gpu-cudnn: the FP8 picks beside cuDNN's FP8, same run
    python3 benchmarks/bench_fp8.py --head-dim 128,64,256 --seqlen 16384,4096 --json $OUT/fp8.json 2>&1 | grep -v Warning
    ;;
  cudnn_d128)  # the last call: d=128 again beside cuDNN, a second sample
    python3 benchmarks/bench_fp8.py --head-dim 128 --seqlen 16384,4096 --json $OUT/fp8_second.json 2>&1 | grep -v Warning
    ;;
esac
