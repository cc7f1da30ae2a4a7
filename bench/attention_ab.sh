#!/usr/bin/env bash
# The decode attention of this tree against REV's in one process (bench/attention_ab.cpp):
# REV's decode_math.h with its namespace renamed, both built with the flags mashbox's native
# build uses. Needs g++ and the .venv's torch.
#
#   bash bench/attention_ab.sh HEAD~1                  # qwen2.5-coder-0.5b's shape, 16,000 positions
#   bash bench/attention_ab.sh HEAD~1 2000 9 3 30      # SmolLM2's, 2,000 positions
set -euo pipefail
cd "$(dirname "$0")/.."
rev=$1
shift
work=$(mktemp -d /tmp/mashbox-attention-ab.XXXXXX)
trap 'rm -rf "$work"' EXIT
git show "$rev:src/mashbox/engine/decode_math.h" |
  sed 's/namespace decode_math {/namespace decode_math_b {/' > "$work/decode_math_b.h"
torch=$(.venv/bin/python -c "import os, torch; print(os.path.dirname(torch.__file__))")
py_include=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['include'])")
py_lib=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))")
py_version=$(.venv/bin/python -c "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')")
g++ -isystem "$torch/include" -isystem "$torch/include/torch/csrc/api/include" \
  -isystem "$py_include" -std=c++20 -O3 -march=native -fopenmp \
  -Isrc/mashbox/engine -I"$work" bench/attention_ab.cpp -L"$torch/lib" -ltorch -ltorch_cpu -ltorch_python -lc10 \
  -L"$py_lib" -lpython"$py_version" -Wl,-rpath,"$torch/lib:$py_lib" -o "$work/attention_ab"
echo "A: this tree ($(git rev-parse --short HEAD)$(git diff --quiet -- src || echo ', modified')); B: $rev"
"$work/attention_ab" "$@"
