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

from support.serverproc import serving  # noqa: E402
from support.tinymodels import build_tiny_llama  # noqa: E402

EXAMPLES = int(os.environ.get("MASHBOX_FUZZ_EXAMPLES", "15"))
KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ALLOWED_HOST = "fuzz.example"


@pytest.fixture(scope="session")
def fuzz_server(tmp_path_factory):
    """Two slots of 128 tokens (any generation a fuzzer starts is short), as a server behind
    a tunnel is run: keys on, another host name allowed, so every fuzzer also goes through
    the key, Host and Origin checks. Fuzzers send AUTH."""
    model = build_tiny_llama(tmp_path_factory.mktemp("fuzz-model"), quantize=True)
    keys = tmp_path_factory.mktemp("fuzz-keys") / "keys"
    keys.write_text(f"{KEY} fuzzer\n")
    with serving(
        str(model), "--ctx", "128", "--slots", "2", "--threads", "1",
        "--api-key-file", str(keys), "--allowed-host", ALLOWED_HOST,
        log=tmp_path_factory.mktemp("fuzz-logs") / "server.log",
    ) as proc:  # fmt: skip
        yield proc
