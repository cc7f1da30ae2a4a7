#!/usr/bin/env bash
# Engine.step on this tree's kernels against REV's, in one process (bench/stack_ab.py): REV's
# sources are built with ChunkPool renamed, since two builds' pools would otherwise share one
# instance (an inline function's static is one symbol process-wide) and hang.
#
#   bash bench/stack_ab.sh HEAD~1 [ROUNDS [REPEAT]]
set -euo pipefail
cd "$(dirname "$0")/.."
rev=$1
work=$(mktemp -d /tmp/mashbox-stack-ab.XXXXXX)
trap 'rm -rf "$work"' EXIT
git archive "$rev" src | tar -x -C "$work"
sed -i 's/^#pragma once/#pragma once\n#define ChunkPool ChunkPoolB/' \
  "$work/src/mashbox/engine/chunk_pool.h"
build='from mashbox.engine import cpu_kernels; print(cpu_kernels.load().__file__)'
library=$(PYTHONPATH="$work/src" .venv/bin/python -c "$build" | tail -1)
echo "A: this tree ($(git rev-parse --short HEAD)$(git diff --quiet -- src || echo ', modified')); B: $rev"
.venv/bin/python bench/stack_ab.py "$library" "${@:2}"
