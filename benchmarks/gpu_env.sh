# Sourced by the benchmarks/run_*.sh scripts on a GPU machine, with OUTDIR as its argument: the CuTe DSL and
# FlashAttention-4 where bundled (.gpu/setup.sh; its report into OUTDIR/setup.log) and, where attnforge is not
# installed, the checkout on PYTHONPATH under the package's name (the repository root is the package).
export PYTHONUNBUFFERED=1
[ -f .gpu/setup.sh ] && source .gpu/setup.sh >"$1/setup.log" 2>&1
if ! python3 -c "import attnforge" 2>/dev/null; then
  mkdir -p /tmp/attnforge-src && ln -sfn "$PWD" /tmp/attnforge-src/attnforge
  export PYTHONPATH=/tmp/attnforge-src${PYTHONPATH:+:$PYTHONPATH}
fi
