"""schemathesis against the OpenAPI document the server serves: no 5xx, no response that
breaks the document, no hang.

Two of schemathesis's checks are left out, on purpose: `negative_data_rejection` (the
contract says fields a route does not use are accepted and ignored, so a wrongly typed
ignored field is not an error) and `positive_data_acceptance` (schema-valid is not always
acceptable: a prompt longer than the context, a tool_choice naming an absent tool).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from conftest import AUTH, EXAMPLES, SEED


def test_schemathesis_finds_nothing(fuzz_server, tmp_path):
    cli = Path(sys.executable).with_name("schemathesis")
    result = subprocess.run(
        [
            str(cli), "run", fuzz_server.url + "/openapi.json",
            "--checks", "all",
            "--exclude-checks", "positive_data_acceptance,negative_data_rejection",
            "--seed", str(SEED),
            "--max-examples", str(EXAMPLES),
            "--request-timeout", "30",  # a hang is a failure
            "--max-failures", "20",
            "--report-dir", str(tmp_path),
            "--header", f"Authorization: {AUTH['Authorization']}",
        ],
        capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    summary = result.stdout[-4000:]
    assert result.returncode == 0, summary
    print(summary)
    assert httpx.get(fuzz_server.url + "/health").json()["status"] == "ok"
