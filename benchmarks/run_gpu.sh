#!/usr/bin/env bash
# Everything attnforge checks on a GPU machine, in one go: install, the test suite (its gpu-marked
# numerics run there), doctor, demo, host overhead and the standard bench grid side by side with the
# peers. Writes log.txt, host_overhead.json, bench.json (updated after each configuration), bench.png
# and bench.txt into OUTDIR.
#
#   bash benchmarks/run_gpu.sh OUTDIR [extra attnforge bench arguments]    (SWEEP=1: also the triton_fa2 tile sweep)
# On the lent H200: run with .gpu carried (../shared/device/gpu-bundle.sh --peers builds it) for
# FlashAttention-4; OUTDIR=$OUT.
set -uo pipefail
out=${1:?usage: bash benchmarks/run_gpu.sh OUTDIR [bench args]}; shift
mkdir -p "$out"
log="$out/log.txt"
export PYTHONUNBUFFERED=1
# CuTe DSL + FlashAttention-4 where bundled (sourced, not piped: a pipe would run it in a subshell)
[ -f .gpu/setup.sh ] && source .gpu/setup.sh >>"$log" 2>&1
# The GPU machine has no network: install without build isolation if pip can, else put the checkout
# on the path under the package's name (the repository root is the package).
if ! python3 -m pip install -q --no-deps --no-build-isolation . >>"$log" 2>&1; then
  mkdir -p /tmp/attnforge-src && ln -sfn "$PWD" /tmp/attnforge-src/attnforge
  export PYTHONPATH=/tmp/attnforge-src${PYTHONPATH:+:$PYTHONPATH}
  echo "pip could not install offline; using the checkout on PYTHONPATH" | tee -a "$log"
fi
nvidia-smi 2>&1 | tee -a "$log"
{ echo "=== doctor"; python3 -m attnforge doctor
  echo "=== tests"; python3 -m pytest tests -q -p no:cacheprovider 2>&1 | tail -n 25
  echo "=== demo"; python3 -m attnforge demo
  echo "=== host overhead"; python3 benchmarks/host_overhead.py --json "$out/host_overhead.json"
  if [ -n "${SWEEP:-}" ]; then echo "=== triton_fa2 tile sweep"; python3 benchmarks/sweep_triton_fa2.py --json "$out/sweep.json"; fi
} 2>&1 | tee -a "$log"
echo "=== bench" | tee -a "$log"
python3 -m attnforge bench --out "$out/bench.json" "$@" 2>&1 | tee "$out/bench.txt"
python3 -m attnforge bench --replot "$out/bench.json" --plot "$out/bench.png" >/dev/null 2>>"$log" \
  || echo "no plot on this machine (matplotlib?); render it elsewhere: attnforge bench --replot bench.json --plot bench.png" | tee -a "$log"
