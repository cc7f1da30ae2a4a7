"""Fuzzing against a real `mashbox run` on a tiny model (see tests/ for the model builders).

MASHBOX_FUZZ_EXAMPLES sets how hard each fuzzer works: small in the default test run, large
in `nox -s fuzz`. MASHBOX_FUZZ_SEED picks schemathesis's cases (the same ones every run by
default; the hypothesis fuzzers draw new ones each run). MASHBOX_FUZZ_URL (`nox -s fuzz --
--url URL`) fuzzes a server already running instead, which must take the key and host name
the fuzzers send, as `fuzz_server` starts its own: a key file holding `fuzz-key`, and
`--allowed-host fuzz.example`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support.serverproc import serving  # noqa: E402
from support.tinymodels import build_tiny_llama  # noqa: E402

EXAMPLES = int(os.environ.get("MASHBOX_FUZZ_EXAMPLES", "15"))
SEED = int(os.environ.get("MASHBOX_FUZZ_SEED", "20261130"))
KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ALLOWED_HOST = "fuzz.example"


@dataclass(frozen=True)
class RunningServer:
    """A server the fuzzers did not start (MASHBOX_FUZZ_URL): only its URL is theirs."""

    url: str


def running_server(url: str) -> RunningServer:
    """The server at url, if it answers and takes the fuzzers' key and host name: each
    fuzzer reads a refusal as the guard working, and would pass without fuzzing anything."""
    url = url.rstrip("/")
    try:
        r = httpx.get(url + "/v1/models", headers={**AUTH, "Host": ALLOWED_HOST}, timeout=30)
    except httpx.TransportError as exc:
        pytest.exit(f"MASHBOX_FUZZ_URL={url}: no server answers ({exc})", returncode=1)
    if r.status_code != 200:
        pytest.exit(
            f"MASHBOX_FUZZ_URL={url}: GET /v1/models with key {KEY!r} and Host {ALLOWED_HOST!r} "
            f"got {r.status_code}; start it with a key file holding {KEY!r} and "
            f"--allowed-host {ALLOWED_HOST}",
            returncode=1,
        )
    return RunningServer(url)


@pytest.fixture(scope="session")
def fuzz_server(tmp_path_factory):
    """Two slots of 128 tokens (any generation a fuzzer starts is short), as a server behind
    a tunnel is run: keys on, another host name allowed, so every fuzzer also goes through
    the key, Host and Origin checks. Fuzzers send AUTH. MASHBOX_FUZZ_URL: that server."""
    if os.environ.get("MASHBOX_FUZZ_URL"):
        yield running_server(os.environ["MASHBOX_FUZZ_URL"])
        return
    model = build_tiny_llama(tmp_path_factory.mktemp("fuzz-model"), quantize=True)
    keys = tmp_path_factory.mktemp("fuzz-keys") / "keys"
    keys.write_text(f"{KEY} fuzzer\n")
    with serving(
        str(model), "--ctx", "128", "--slots", "2", "--threads", "1",
        "--api-key-file", str(keys), "--allowed-host", ALLOWED_HOST,
        log=tmp_path_factory.mktemp("fuzz-logs") / "server.log",
    ) as proc:  # fmt: skip
        yield proc
