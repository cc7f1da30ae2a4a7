#!/usr/bin/env bash
# The decode kernels of this tree against REV's in one process (bench/kernel_ab.cpp): builds
# both trees' rounded_gemm.cpp with the flags mashbox's native build uses (REV's symbols,
# ChunkPool included, renamed), then runs the harness. Needs g++ and the .venv's torch.
#
#   bash bench/kernel_ab.sh HEAD~1          # 2 threads, 1 row
#   bash bench/kernel_ab.sh HEAD~1 1 8      # 1 thread, 8 rows
#   bash bench/kernel_ab.sh HEAD~1 2 1 qwen # qwen2.5-coder-0.5b's Q5_0, Q6_K and Q8_0 kernels
set -euo pipefail
cd "$(dirname "$0")/.."
rev=$1
shift
work=$(mktemp -d /tmp/mashbox-kernel-ab.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/b"
git archive "$rev" src/mashbox/engine | tar -x -C "$work/b"
source bench/native_flags.sh
rename=(-DChunkPool=ChunkPoolB -Dq4a16_gemm=q4a16_gemm_B -Dq4a8_gemm=q4a8_gemm_B
  -Dq5a8_gemm=q5a8_gemm_B -Dq5a16_gemm=q5a16_gemm_B -Dq8a16_gemm=q8a16_gemm_B
  -Dq6a16_gemm=q6a16_gemm_B -DRounded=RoundedB)
a=src/mashbox/engine b=$work/b/src/mashbox/engine
g++ "${flags[@]}" -I"$a" -c "$a/rounded_gemm.cpp" -o "$work/a.o" & pids=($!)
g++ "${flags[@]}" "${rename[@]}" -I"$b" -c "$b/rounded_gemm.cpp" -o "$work/b.o" & pids+=($!)
g++ "${flags[@]}" -I"$a" -c bench/kernel_ab.cpp -o "$work/main.o" & pids+=($!)
for pid in "${pids[@]}"; do wait "$pid"; done
g++ "$work/main.o" "$work/a.o" "$work/b.o" "${libs[@]}" -o "$work/kernel_ab"
echo "A: this tree ($(git rev-parse --short HEAD)$(git diff --quiet -- src || echo ', modified')); B: $rev"
"$work/kernel_ab" "$@"
