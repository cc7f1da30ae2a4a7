#!/usr/bin/env bash
# The decode attention of this tree against REV's in one process (bench/attention_ab.cpp):
# REV's decode_math.h with its namespace renamed, both built with the flags mashbox's native
# build uses. Needs g++ and the .venv's torch.
#
#   bash bench/attention_ab.sh HEAD~1                # qwen2.5-coder-0.5b: 16,000 positions
#   bash bench/attention_ab.sh HEAD~1 2000 9 3 30    # SmolLM2: 2,000 positions
set -euo pipefail
cd "$(dirname "$0")/.."
rev=$1
shift
work=$(mktemp -d /tmp/mashbox-attention-ab.XXXXXX)
trap 'rm -rf "$work"' EXIT
git show "$rev:src/mashbox/engine/decode_math.h" |
  sed 's/namespace decode_math {/namespace decode_math_b {/' > "$work/decode_math_b.h"
source bench/native_flags.sh
g++ "${flags[@]}" -Isrc/mashbox/engine -I"$work" bench/attention_ab.cpp "${libs[@]}" \
  -o "$work/attention_ab"
echo "A: this tree ($(git rev-parse --short HEAD)$(git diff --quiet -- src || echo ', modified')); B: $rev"
"$work/attention_ab" "$@"
