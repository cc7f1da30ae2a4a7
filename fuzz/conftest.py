"""Fuzzing against a real `mashbox run` on a tiny model (see tests/ for the model builders).

MASHBOX_FUZZ_EXAMPLES sets how hard each fuzzer works: small in the default test run, large
in `nox -s fuzz`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from serverproc import serving  # noqa: E402
from tinymodels import build_tiny_llama  # noqa: E402

EXAMPLES = int(os.environ.get("MASHBOX_FUZZ_EXAMPLES", "15"))


@pytest.fixture(scope="session")
def fuzz_server(tmp_path_factory):
    """Two slots of 128 tokens: any generation a fuzzer starts is short."""
    model = build_tiny_llama(tmp_path_factory.mktemp("fuzz-model"), quantize=True)
    with serving(
        str(model), "--ctx", "128", "--slots", "2", "--threads", "1",
        log=tmp_path_factory.mktemp("fuzz-logs") / "server.log",
    ) as proc:  # fmt: skip
        yield proc
