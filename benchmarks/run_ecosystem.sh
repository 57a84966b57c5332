#!/usr/bin/env bash
# attnforge in torch's training ecosystem, on a GPU: the compiled-training and flash-implementation tests,
# a compiled Hugging Face Llama step (Decisions, gradients, eager vs compiled step time; also through SDPA
# with attnforge active as torch's flash implementation), and the standard forward grid through SDPA with
# attnforge active against stock SDPA and the peers. Writes into OUTDIR.
#
#   bash benchmarks/run_ecosystem.sh OUTDIR         (NO_GRID=1: without the forward grid)
set -uo pipefail
out=${1:?usage: bash benchmarks/run_ecosystem.sh OUTDIR}
mkdir -p "$out"
source benchmarks/gpu_env.sh "$out"
git rev-parse HEAD > "$out/commit.txt" 2>/dev/null || true
python3 -m pytest -q -p no:cacheprovider -rf tests/test_op.py tests/integrations tests/test_autocast.py > "$out/tests.txt" 2>&1
{ echo "=== tests"; grep -E "^(FAILED|ERROR)|passed|failed" "$out/tests.txt"
  echo "=== compiled step"; python3 benchmarks/compiled_step.py --json "$out/compiled_step.json" 2>&1 | tail -n 60
} 2>&1 | tee "$out/log.txt"
[ -n "${NO_GRID:-}" ] && exit 0
python3 -m attnforge bench --dtype bf16 --mode fwd --backends auto,sdpa-flash,sdpa-flash-attnforge,sdpa-cudnn,fa4 \
  --out "$out/bench.json" 2>&1 | tee "$out/bench.txt"
