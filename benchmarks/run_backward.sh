#!/usr/bin/env bash
# The cute_sm90 backward on the lent H200. Steps (STEPS, default "tests bench"):
#   tests  the backward's GPU tests against fp64 (tests/backends/cute_sm90/test_gpu_backward.py; TESTS_K filters);
#   forms  the GPU tests of the kernel-128 tiles' feature and packed forms (test_gpu_features.py's forced backward at
#          d=128, 96 and 80 and test_gpu_varlen.py at d=128 and 96), which serve the table's unmasked-only tiles
#          whatever bwd_variants.UNMASKED_ONLY_SERVED says: with `tests`, what serving d=128's 80-row tile waits for;
#   bench  forward+backward at d=64/128 (BENCH_DIMS), N=1k/4k/16k, 16k tokens, against cuDNN and FA4 (`attnforge
#          bench --mode fwd+bwd`: FLOPs 3.5x the forward's 4 N^2 d per head, halved causal);
#   gqa    a Llama-style GQA 32/8 causal training shape (d=128, N=8k, batch 2) against cuDNN and FA4.
#   sweep  the table's backward kernels, served or not (benchmarks/sweep_bwd_sm90.py: each checked against fp64 first),
#          at SWEEP_DIMS (default 256) and N=1k/4k/16k, beside cuDNN and FA4, deterministic forms included.
#   twin   an A/B of template options: the table's tiles at AB_DIMS (default 128) beside their twins with the boolean
#          Sm90BwdTile fields of each word of TWIN turned on, or FIELD=N set (fields joined by +; sweep_bwd_sm90.py
#          --twin), N=1k/4k/16k,
#          5 rounds, with the peers.
#   profile where a step's GPU time goes at d=128, N=1k and 16k (benchmarks/profile_step.py), beside cuDNN and FA4.
#   timeline where each CTA's (or persistent tile's) cycles go at TIMELINE_DIM (default 128), N=1k causal: the table's
#          kernel and its persistent twin (benchmarks/timeline_bwd_sm90.py).
#   bash benchmarks/run_backward.sh OUTDIR;  STEPS="tests sweep" TESTS_K=256 bash benchmarks/run_backward.sh OUTDIR
#   STEPS="twin profile" TWIN="stats_ahead ds_key_major tma_store_dkv stats_ahead+ds_key_major+tma_store_dkv \
#   tile_m=80+dq_transposed tile_m=80+dq_transposed+ds_key_major+tma_store_dkv" \
#     bash benchmarks/run_backward.sh OUTDIR
#   (a twin with unmasked_only, e.g. tile_m=80+dq_transposed+tma_store_dkv+unmasked_only, is timed without a mask only)
set -uo pipefail
out=${1:?usage: bash benchmarks/run_backward.sh OUTDIR}; mkdir -p "$out"
source benchmarks/gpu_env.sh "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv | tee -a "$out/log.txt"
for step in ${STEPS:-tests bench}; do
  echo "=== $step" | tee -a "$out/log.txt"
  case $step in
    tests) timeout "${TEST_S:-300}" python3 -m pytest tests/backends/cute_sm90/test_gpu_backward.py -q -p no:cacheprovider \
             -rf -x ${TESTS_K:+-k "$TESTS_K"} > "$out/tests.txt" 2>&1
           grep -E "^(FAILED|ERROR|E  )|passed|failed" "$out/tests.txt" | tail -n 30 | tee -a "$out/log.txt" ;;
    forms) for f in test_gpu_features test_gpu_varlen; do
             k=$([[ $f == test_gpu_features ]] && echo "forced and (-128] or -96] or -80])" || echo "d128 or d96")
             timeout "${TEST_S:-300}" python3 -m pytest tests/backends/cute_sm90/$f.py -q -p no:cacheprovider -rf \
               -k "$k" > "$out/$f.txt" 2>&1
             grep -E "^(FAILED|ERROR)|passed|failed" "$out/$f.txt" | tail -n 30 | tee -a "$out/log.txt"
           done ;;
    bench) timeout "${BENCH_S:-240}" python3 -m attnforge bench --dtype bf16 --mode fwd+bwd --head-dim "${BENCH_DIMS:-64,128}" \
             --seqlen "${BENCH_SEQLEN:-1024,4096,16384}" --backends cute_sm90,sdpa-cudnn,fa4 --baseline fa4 \
             --out "$out/bench.json" 2>&1 | grep -v Warning | tee "$out/bench.txt" | tail -n 40 ;;
    gqa) timeout "${GQA_S:-120}" python3 -m attnforge bench --dtype bf16 --mode fwd+bwd --head-dim 128 --seqlen 8192 \
             --tokens 16384 --heads 32 --kv-heads 8 --causal true --backends auto,cute_sm90,sdpa-cudnn,fa4 --baseline fa4 \
             --out "$out/gqa.json" 2>&1 | grep -v Warning | tee "$out/gqa.txt" | tail -n 20 ;;
    sweep) timeout "${SWEEP_S:-420}" python3 benchmarks/sweep_bwd_sm90.py --head-dim "${SWEEP_DIMS:-256}" \
             --seqlen "${SWEEP_SEQLEN:-16384,4096,1024}" --rounds 3 --json "$out/sweep.json" 2>&1 | grep -v Warning \
             | tee "$out/sweep.txt" | tail -n 30 ;;
    twin) timeout "${TWIN_S:-420}" python3 benchmarks/sweep_bwd_sm90.py --head-dim "${AB_DIMS:-128}" \
             --seqlen "${SWEEP_SEQLEN:-16384,4096,1024}" --rounds 5 --no-deterministic $(printf -- '--twin %s ' ${TWIN:?TWIN=field[+field] ...}) \
             --json "$out/twin.json" 2>&1 | grep -v Warning | tee "$out/twin.txt" | tail -n 30 ;;
    timeline) for p in "" --persistent; do
             timeout "${TIMELINE_S:-120}" python3 benchmarks/timeline_bwd_sm90.py --head-dim "${TIMELINE_DIM:-128}" \
               --seqlen 1024 --causal $p --json "$out/timeline${p:+-persistent}.json" 2>&1 | grep -v Warning \
               | tail -n 24 | tee -a "$out/log.txt"
           done ;;
    profile) timeout "${PROFILE_S:-180}" python3 benchmarks/profile_step.py --head-dim 128 --seqlen 1024,16384 \
             --json "$out/profile.json" 2>&1 | grep -v Warning | tee "$out/profile.txt" | tail -n 40 ;;
  esac
done
