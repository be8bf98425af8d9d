#!/usr/bin/env bash
# Prepares an A/B of the working tree against an earlier commit on the device machine, whose copy
# of the repository has no git history: the package as it was at BASE goes to bench/out/base_src
# (git-ignored; carry it), without the bundled models (the `budget_ab` stage links the working
# tree's). Both sides run the working tree's bench script, so BASE must share its package API.
# Then, with `bench/out/base_src` and `.gpu-wheels/site.tar.xz` carried:
#
#   bash bench/ab_base.sh 46b4836
#   OUT=$OUT bash bench/h200_run.sh budget_ab      # base, head, base, head: budget_sweep.py each
set -euo pipefail
base=${1:?usage: bash bench/ab_base.sh BASE_COMMIT}
cd "$(dirname "$0")/.."
rm -rf bench/out/base_src
mkdir -p bench/out/base_src
git archive "$base" ddtree_serve | tar -x -C bench/out/base_src --exclude ddtree_serve/bundled
echo "bench/out/base_src: ddtree_serve at $(git rev-parse --short "$base") ($(du -sh bench/out/base_src | cut -f1))"
