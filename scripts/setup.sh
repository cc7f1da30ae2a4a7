#!/usr/bin/env bash
# Create .venv with the CPU build of torch, mashbox and its test tools. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    .venv/bin/python -m pip install --quiet torch
  else
    # The CPU build: an unpinned torch would pull a multi-GB CUDA build.
    .venv/bin/python -m pip install --quiet torch==2.13.0
  fi
fi
.venv/bin/python -m pip install --quiet -e '.[test]'
# mashbox's CPU kernels (src/mashbox/engine/*.cpp) need g++; build them now, once per
# machine, so no server or test compiles. Where they cannot build, `mashbox kernels` says
# why and mashbox runs on torch's slower ops (the tests then fail on a machine with AVX2).
if ! command -v g++ >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null
fi
.venv/bin/mashbox kernels || echo "setup.sh: no CPU kernels (above): decode will be slow" >&2
# The browser tests (tests/test_ui.py) drive Debian's chromium through Playwright's Python
# package; Playwright's own browser download is never used.
if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "setup.sh: install Debian's chromium (apt-get install chromium) for tests/test_ui.py" >&2
  fi
fi
