#!/usr/bin/env bash
# cute_sm90 at every head dim, on the lent H200. Steps (STEPS, default "build tests sweep"):
#   build  every served cute_sm90 kernel compiled ahead of time (`attnforge build --jobs`);
#   tests  the GPU tests against fp64 with poisoned outputs at every head dim (TESTS_K: a pytest -k filter);
#   sweep  the tile sweep at the head dims of variants.FWD_RANGES (benchmarks/sweep_cute_sm90.py);
#   costs  `attnforge tune --costs` at COST_DIMS (default 80,96,192) and COST_TOKENS (default 16384);
#   bench  the forward grid at 80/96/192 against cuDNN, SDPA's flash and FA4;
#   check  benchmarks/dispatch_check.py (auto against every backend and stock SDPA on realistic shapes).
#   bash benchmarks/run_head_dims.sh OUTDIR
set -uo pipefail
out=${1:?usage: bash benchmarks/run_head_dims.sh OUTDIR}; mkdir -p "$out"
source benchmarks/gpu_env.sh "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv | tee -a "$out/log.txt"
for step in ${STEPS:-build tests sweep}; do
  echo "=== $step" | tee -a "$out/log.txt"
  case $step in
    build) ( time python3 -m attnforge build --target sm90 --backend cute_sm90 --dtype bf16,fp16 --jobs "${JOBS:-14}" ) \
             > "$out/build.txt" 2>&1; tail -n 4 "$out/build.txt" | tee -a "$out/log.txt" ;;
    tests) timeout "${TEST_S:-240}" python3 -m pytest tests/backends/cute_sm90/test_gpu.py -q -p no:cacheprovider -rf \
             -k "${TESTS_K:-poisoned_outputs_match_fp64 or persistent_ctas}" > "$out/tests.txt" 2>&1
           grep -E "^(FAILED|ERROR)|passed|failed" "$out/tests.txt" | tail -n 30 | tee -a "$out/log.txt" ;;
    sweep) timeout "${SWEEP_S:-260}" python3 benchmarks/sweep_cute_sm90.py --json "$out/sweep.json" \
             --head-dim "${DIMS:-80,96,192,48,112,160,224}" --seqlen 4096,16384 2>&1 | grep -v Warning | tee -a "$out/log.txt" ;;
    costs) timeout "${COSTS_S:-300}" python3 -m attnforge tune --costs --head-dim "${COST_DIMS:-80,96,192}" \
             --tokens "${COST_TOKENS:-16384}" --out "$out/costs.json" 2>&1 | grep -v Warning | tee "$out/tune.log" | tail -n 3 ;;
    bench) timeout "${BENCH_S:-200}" python3 -m attnforge bench --dtype bf16 --mode fwd --head-dim 80,96,192 \
             --seqlen 1024,4096,16384 --backends cute_sm90,sdpa-cudnn,sdpa-flash,fa4 --out "$out/bench.json" 2>&1 \
             | grep -v Warning | tee "$out/bench.txt" | tail -n 40 ;;
    check) timeout "${CHECK_S:-240}" python3 benchmarks/dispatch_check.py --json "$out/dispatch_check.json" 2>&1 \
             | grep -v Warning | tee "$out/dispatch_check.txt" | tail -n 40 ;;
  esac
done
