#!/usr/bin/env bash
# Paged decode with KVTile.lookahead (block-table entries read a key step ahead) beside the same tiles without it, on
# the lent GPU, Triton only: benchmarks/decode_floor.py --paged --sweep at batch 1, 4 and 16 (one query, 8k keys,
# GQA 32/8, d=128, bf16, pages of 64; per layer in a CUDA graph of 16 calls; every swept tile checked against fp32
# math first), the paged table tile (64x128 w4 s2, packed to 16 rows) and the 3-stage tile, each with and without
# lookahead, at 16 and 32 splits. Each batch is one process under its own time limit (LIMIT, default 170 s).
# Usage: benchmarks/run_paged_lookahead.sh OUTDIR
set -uo pipefail
OUT=${1:?usage: run_paged_lookahead.sh OUTDIR}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh "$OUT"
git log -1 --format=%h > "$OUT/commit.txt" 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
tiles="16,128,4,2;16,128,4,2,1;16,128,4,3;16,128,4,3,1"
for batch in ${BATCHES:-1 4 16}; do
  (cd benchmarks && timeout "${LIMIT:-170}" python3 decode_floor.py --paged --sweep --splits 16,32 --batch "$batch" \
    --tiles "$tiles" --json "$OUT/lookahead_b$batch.json") > "$OUT/lookahead_b$batch.txt" 2>&1
  echo "batch $batch: rc=$?"
done
