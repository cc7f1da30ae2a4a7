"""The pytest plugin installed with mashbox (entry point `pytest11`): a `mashbox_server`
fixture for other projects' tests.

    def test_hello(mashbox_server):
        client = openai.OpenAI(base_url=mashbox_server + "/v1", api_key="none")

`mashbox_server` is the base URL (`http://127.0.0.1:PORT`) of one real `mashbox run` per test
session, stopped at its end. `--mashbox-model` or $MASHBOX_TEST_MODEL picks the model
(default mashbox-tiny: no download), `--mashbox-arg` adds flags to `mashbox run`
(repeatable), `--mashbox-key` or $MASHBOX_TEST_KEY starts it with a key, which the
`mashbox_api_key` fixture gives (None without). Nothing starts unless a test asks for it.
"""

from __future__ import annotations

import os

import pytest

from .testing import MashboxServer, running_server
from .tiny import TINY_ID


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("mashbox", "a real mashbox server for the tests")
    group.addoption(
        "--mashbox-model",
        default=os.environ.get("MASHBOX_TEST_MODEL", TINY_ID),
        help=f"the model mashbox_server serves (default $MASHBOX_TEST_MODEL or {TINY_ID})",
    )
    group.addoption(
        "--mashbox-arg",
        action="append",
        default=[],
        help="a flag for `mashbox run` (repeatable), e.g. --mashbox-arg=--slots=8",
    )
    group.addoption(
        "--mashbox-key",
        default=os.environ.get("MASHBOX_TEST_KEY"),
        help="start the server with this API key (default $MASHBOX_TEST_KEY; none)",
    )


@pytest.fixture(scope="session")
def mashbox_running(request: pytest.FixtureRequest):
    """The session's server, as mashbox.testing.MashboxServer (url, key, log lines)."""
    config = request.config
    model = config.getoption("--mashbox-model")
    args = config.getoption("--mashbox-arg")
    with running_server(model, *args, key=config.getoption("--mashbox-key")) as server:
        yield server


@pytest.fixture(scope="session")
def mashbox_server(mashbox_running: MashboxServer) -> str:
    """The base URL of the session's mashbox server: `http://127.0.0.1:PORT`."""
    return mashbox_running.url


@pytest.fixture(scope="session")
def mashbox_api_key(mashbox_running: MashboxServer) -> str | None:
    """The key clients must send to the session's server, or None when it has none."""
    return mashbox_running.key
