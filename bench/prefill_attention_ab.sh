#!/usr/bin/env bash
# The prefill attention of this tree against REV's in one process
# (bench/prefill_attention_ab.cpp): REV's prefill_attention.cpp, its entry renamed and its
# decode_math namespace too, built against REV's headers as an object of its own; both with
# the flags mashbox's native build uses. Needs g++ and the .venv's torch.
#
#   bash bench/prefill_attention_ab.sh HEAD~1                 # qwen2.5-coder-0.5b, 16k
#   bash bench/prefill_attention_ab.sh HEAD~1 2048 256 9 3    # SmolLM2, 2k
set -euo pipefail
cd "$(dirname "$0")/.."
rev=$1
shift
work=$(mktemp -d /tmp/mashbox-prefill-attention-ab.XXXXXX)
trap '[ -n "${KEEP:-}" ] || rm -rf "$work"' EXIT
engine=src/mashbox/engine
for f in cpu_kernels.h chunk_pool.h decode_math.h prefill_attention.cpp; do
  git show "$rev:$engine/$f" | sed -e 's/namespace decode_math\b/namespace decode_math_b/' \
    -e 's/^torch::Tensor prefill_attention(/torch::Tensor prefill_attention_b(/' > "$work/$f"
done
source bench/native_flags.sh
g++ "${flags[@]}" -I"$engine" -c "$engine/prefill_attention.cpp" -o "$work/a.o" &
g++ "${flags[@]}" -I"$work" -c "$work/prefill_attention.cpp" -o "$work/b.o" &
g++ "${flags[@]}" -c bench/prefill_attention_ab.cpp -o "$work/main.o" &
wait
g++ "$work/main.o" "$work/a.o" "$work/b.o" "${libs[@]}" -o "$work/prefill_attention_ab"
echo "A: this tree ($(git rev-parse --short HEAD)$(git diff --quiet -- src || echo ', modified')); B: $rev"
"$work/prefill_attention_ab" "$@"
