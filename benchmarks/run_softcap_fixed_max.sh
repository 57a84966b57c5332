#!/usr/bin/env bash
# The bf16 softcap forward with FIXED_MAX (one fixed max instead of a running one; templates/cute_sm90_fwd.py.jinja)
# beside the same tile's running-max SOFTCAP kernel and the plain kernel, in interleaved rounds on the same inputs
# (benchmarks/ab_variant.py --softcap --fixed-max), d=64 and 128, 4k and 16k tokens per sequence, full and causal;
# each output poisoned first and compared with fp32 math. FLAGS: the tile variants timed beside the pick, each with
# its FIXED_MAX twin too (default: one exp2 in three on the FMA pipe); CAPS: the softcaps (default 30 and 50).
# Usage: run_softcap_fixed_max.sh OUTDIR
set -uo pipefail
OUT=${1:?usage: run_softcap_fixed_max.sh OUTDIR}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh "$OUT"
git log -1 --format=%h > "$OUT/commit.txt" 2>/dev/null
for cap in ${CAPS:-30 50}; do
  python3 benchmarks/ab_variant.py --kind 16bit --softcap $cap --fixed-max --head-dim 64,128 --seqlen 4096,16384 \
    --flags "${FLAGS:-exp2_fma_every=3}" --rounds 5 --json "$OUT/softcap${cap}_fixed_max.json" 2>&1 \
    | tee "$OUT/softcap${cap}_fixed_max.log" | grep "TFLOP"
done
