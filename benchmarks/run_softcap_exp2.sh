#!/usr/bin/env bash
# The softcap forward with part of its exp2s on the FMA pipe (Sm90FwdTile.exp2_fma_every), against the same tile
# with every exp2 on MUFU and against the plain (no softcap) kernel, in interleaved rounds on the same inputs
# (benchmarks/ab_variant.py --softcap), d=64 and 128, 4k and 16k tokens per sequence, full and causal; each output
# poisoned first and compared with fp32 math. Usage: benchmarks/run_softcap_exp2.sh OUTDIR
set -uo pipefail
OUT=${1:?usage: run_softcap_exp2.sh OUTDIR}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh "$OUT"
git log -1 --format=%h > "$OUT/commit.txt" 2>/dev/null
python3 benchmarks/ab_variant.py --kind 16bit --softcap 30 --head-dim 64,128 --seqlen 4096,16384 \
  --flags exp2_fma_every=2,exp2_fma_every=3,exp2_fma_every=4,exp2_fma_every=8 --rounds 5 \
  --json "$OUT/softcap_exp2.json" 2>&1 | tee "$OUT/softcap_exp2.log" | grep "TFLOP"
