#!/usr/bin/env bash
# Decode on the lent GPU after a KV-cache kernel change: the KV-cache GPU tests, benchmarks/decode_floor.py (batch 1 /
# 8k: per-layer device time from a graph of many layers, one-call replays, each kernel's profiled time, the copy of
# the same bytes and SDPA beside it), then benchmarks/bench_kvcache.py (the three shapes, paged too, with
# SDPA and FlashAttention-4 where bundled). Usage: benchmarks/run_decode_floor.sh OUTDIR
set -uo pipefail
OUT=${1:?usage: run_decode_floor.sh OUTDIR}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh "$OUT"
git log -1 --format=%h > "$OUT/commit.txt" 2>/dev/null
(cd /tmp && timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -c "$OLDPWD/tests/pytest.ini" \
  "$OLDPWD/tests/backends/triton_fa2/test_kvcache_gpu.py") 2>&1 | tail -25 | tee "$OUT/tests.log"
(cd benchmarks && python3 decode_floor.py --json "$OUT/decode_floor.json") 2>&1 | tee "$OUT/decode_floor.log"
python3 benchmarks/bench_kvcache.py --json "$OUT/kvcache.json" 2>&1 | tee "$OUT/bench.log"
