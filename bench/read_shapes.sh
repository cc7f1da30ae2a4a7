#!/usr/bin/env bash
# The pool reading a decode step's weight bytes matrix by matrix, in one call, and as two
# streams (bench/read_shapes.cpp), built with the flags mashbox's native build uses.
#
#   bash bench/read_shapes.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d /tmp/mashbox-read-shapes.XXXXXX)
trap 'rm -rf "$work"' EXIT
source bench/native_flags.sh
g++ "${flags[@]}" -Isrc/mashbox/engine bench/read_shapes.cpp "${libs[@]}" -o "$work/read_shapes"
"$work/read_shapes" "$@"
