#!/usr/bin/env bash
# Session 8 device runs: bash benchmarks/results/2026-11-30-h200-cute_sm90-session8/run.sh STEP
# (carry .gpu, or .gpu-cudnn for the steps beside cuDNN on a machine that ran a .gpu step; writes into $OUT).
set -uo pipefail
for f in .gpu/setup.sh .gpu-cudnn/setup.sh; do [ -f $f ] && source $f; done
mkdir -p /tmp/af && ln -sfn "$PWD" /tmp/af/attnforge
export PYTHONPATH=/tmp/site:/tmp/af:$PYTHONPATH TRITON_DEFAULT_FP_FUSION=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
case "$1" in
  tma)  # the TMA-store epilogue (tma_store) beside each pick, interleaved, outputs compared with the pick's
    python3 benchmarks/ab_variant.py --flags tma_store --seqlen 4096,16384 --rounds 5 --json $OUT/tma_store.json 2>&1 | grep -v Warning
    ;;
  more)  # 16-bit d=256 with the TMA store staged in Q's buffer; FP8 d=128 persistent or 3 stages now that the
    # epilogue is shorter; tail split on the other one-CTA-per-tile picks (bf16 d=64 at 8 heads, FP8 d=256)
    python3 benchmarks/ab_variant.py --flags tma_store --kind 16bit --head-dim 256 --seqlen 1024,4096,16384 \
      --json $OUT/tma_store_d256.json 2>&1 | grep -v Warning
    python3 benchmarks/ab_variant.py --flags "persistent+tail_split=0,kv_stages=3,tail_split=0" --kind fp8 --head-dim 128 \
      --seqlen 4096,16384 --causal full --json $OUT/fp8_d128_persistent.json 2>&1 | grep -v Warning
    python3 benchmarks/ab_variant.py --flags tail_split --kind 16bit --head-dim 64 --heads 8 --seqlen 4096,16384 \
      --causal full --json $OUT/split_d64_h8.json 2>&1 | grep -v Warning
    python3 benchmarks/ab_variant.py --flags tail_split --kind fp8,16bit --head-dim 256 --seqlen 4096,16384 \
      --causal full --json $OUT/split_d256.json 2>&1 | grep -v Warning
    ;;
  tests)  # the picks with the TMA-store epilogue: the GPU suite (fp64 references, NaN-poisoned outputs)
    timeout 560 python3 -m pytest tests/backends/cute_sm90 tests/test_api.py -q -p no:cacheprovider \
      -k "cute_sm90 or fp8 or cuda" 2>&1 | tail -n 8
    ;;
  ab)  # carry .gpu-cudnn: FP8 d=128 beside cuDNN's FP8, interleaved rounds; then launch cost and peak memory
    python3 benchmarks/ab_fp8.py --head-dim 128 --seqlen 16384 --rounds 9 --json $OUT/ab_16k.json 2>&1 | grep -v Warning
    python3 benchmarks/ab_fp8.py --head-dim 128 --seqlen 16384 --rounds 5 --causal --json $OUT/ab_16k_causal.json 2>&1 | grep -v Warning
    python3 benchmarks/ab_fp8.py --head-dim 128 --seqlen 4096 --rounds 5 --json $OUT/ab_4k.json 2>&1 | grep -v Warning
    python3 benchmarks/launch_cost.py --json $OUT/launch_cost.json 2>&1 | grep -v Warning
    python3 benchmarks/peak_memory.py --json $OUT/peak_memory.json 2>&1 | grep -v Warning
    ;;
  final)  # carry .gpu-cudnn, after a .gpu step: launch cost (the tiny bf16 d=64 call now takes the tail-split path),
    # bf16 beside cuDNN (SDPA) at N=16k, FP8 d=128 beside cuDNN's FP8, interleaved
    python3 benchmarks/launch_cost.py --json $OUT/launch_cost_final.json 2>&1 | grep -v Warning
    python3 -m attnforge bench --mode fwd --head-dim 64,128,256 --seqlen 16384 --backends cute_sm90,sdpa-cudnn \
      --out $OUT/bench_final.json 2>&1 | grep -v Warning | tail -n 14
    python3 benchmarks/ab_fp8.py --head-dim 128 --seqlen 16384 --rounds 5 --json $OUT/ab_16k_final.json 2>&1 | grep -v Warning
    ;;
  last)  # the final tree (d=64 without the tail split again): launch cost twice; bf16 d=128 beside cuDNN and FA4
    python3 benchmarks/launch_cost.py --json $OUT/launch_cost_last.json 2>&1 | grep -v Warning | grep -v exe_args
    python3 benchmarks/launch_cost.py --json $OUT/launch_cost_last_again.json 2>&1 | grep -v Warning | grep -v exe_args
    python3 -m attnforge bench --mode fwd --head-dim 128 --seqlen 4096,16384 --backends cute_sm90,sdpa-cudnn,fa4 \
      --out $OUT/bench_d128_last.json 2>&1 | grep -v Warning | grep -E "^(bf16|  impl|  cute|  sdpa|  fa4)"
    ;;
esac
