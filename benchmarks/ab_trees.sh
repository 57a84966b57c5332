#!/usr/bin/env bash
# A/B of two source trees of attnforge in one GPU run: `attnforge bench` from the checkout and from another
# tree (an earlier commit's files), in alternating rounds (A, B, A, B, ...), on the same inputs (the bench's
# fixed seed), each tree with its own build cache. For changes that must not move a number (a refactor):
# the rounds' spread shows the noise, the trees' medians the difference.
#
#   bash benchmarks/ab_trees.sh OTHER_TREE OUTDIR ROUNDS [attnforge bench arguments]
#
# Writes OUTDIR/bench_<tree>_<round>.json (tree: this, other) and OUTDIR/ab.txt (benchmarks/ab_trees.py).
# OTHER_TREE: e.g. `git worktree add /tmp/base <commit>` or a copy of its files. With .gpu carried (the CuTe
# DSL and FlashAttention-4), source .gpu/setup.sh first.
set -uo pipefail
other=${1:?usage: bash benchmarks/ab_trees.sh OTHER_TREE OUTDIR ROUNDS [bench args]}
out=${2:?OUTDIR}; rounds=${3:?ROUNDS}; shift 3
mkdir -p "$out" /tmp/ab-this /tmp/ab-other
ln -sfn "$PWD" /tmp/ab-this/attnforge
ln -sfn "$(cd "$other" && pwd)" /tmp/ab-other/attnforge
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
for round in $(seq 1 "$rounds"); do
  for tree in other this; do
    echo "=== round $round: $tree"
    PYTHONPATH=/tmp/ab-$tree${PYTHONPATH:+:$PYTHONPATH} ATTNFORGE_CACHE_DIR=/tmp/ab-cache-$tree \
      python3 -m attnforge bench --out "$out/bench_${tree}_${round}.json" "$@" 2>&1 | grep -v Warning | tail -n 3
  done
done
python3 "$(dirname "$0")/ab_trees.py" "$out" | tee "$out/ab.txt"
