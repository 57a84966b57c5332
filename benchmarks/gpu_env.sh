# Sourced by the benchmarks/run_*.sh scripts on a GPU machine, with OUTDIR as its argument: the CuTe DSL and
# FlashAttention-4 where bundled (.gpu/setup.sh, then .gpu-libs/setup.sh; their report into OUTDIR/setup.log) and,
# where attnforge is not installed, the checkout on PYTHONPATH under the package's name (the repository root is the
# package). The bundle may come in two parts, the wheels (.gpu) and the DSL's CUDA libraries (.gpu-libs), when both
# with the checkout exceed what one copy to the machine holds: each part installs once per machine into /tmp/site,
# the wheels first (pip --target replaces a package's folder, the libraries' files with it).
export PYTHONUNBUFFERED=1
: >"$1/setup.log"
for _setup in .gpu/setup.sh .gpu-libs/setup.sh; do [ -f $_setup ] && source $_setup >>"$1/setup.log" 2>&1; done
unset _setup
if ! python3 -c "import attnforge" 2>/dev/null; then
  mkdir -p /tmp/attnforge-src && ln -sfn "$PWD" /tmp/attnforge-src/attnforge
  export PYTHONPATH=/tmp/attnforge-src${PYTHONPATH:+:$PYTHONPATH}
fi
