"""A real `mashbox run` for other projects' tests.

    from mashbox.testing import running_server

    with running_server("mashbox-tiny") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.key or "none")

`mashbox-tiny` (the default here) needs no download and is ready in about two seconds the
first time; any model `mashbox run` takes works. With pytest, the `mashbox_server` fixture
does the same once per session (mashbox.pytest_plugin, found through its entry point).
Only the standard library is imported here: the server runs in its own process.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

from .tiny import TINY_ID

_LISTENING = re.compile(r"listening on (http://\S+)")


@dataclass
class MashboxServer:
    """A running server: its base URL (`http://127.0.0.1:PORT`), its key (None without),
    and the log lines it has written so far."""

    url: str
    key: str | None
    lines: list[str] = field(default_factory=list)


class ServerFailed(RuntimeError):
    """The server exited or did not get ready in time; the message ends with its log."""


@contextlib.contextmanager
def running_server(
    model: str = TINY_ID,
    *args: str,
    key: str | None = None,
    timeout: float = 600.0,
    env: dict[str, str] | None = None,
) -> Iterator[MashboxServer]:
    """Start `mashbox run MODEL ARGS` on a free port, wait until /health says ready, yield it,
    and stop it (SIGINT, then a kill after 15 s) however the block ends. With `key`, clients
    must send it (Authorization: Bearer or x-api-key)."""
    environ = {**os.environ, **(env or {})}
    if key is not None:
        environ["MASHBOX_API_KEY"] = key
    cmd = [sys.executable, "-m", "mashbox.cli", "run", model, "--port", "0", *args]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environ
    )
    lines: list[str] = []
    listening = threading.Event()
    url: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if not url and (m := _LISTENING.search(line)):
                url.append(m.group(1))
                listening.set()
        listening.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        server = MashboxServer(_wait_ready(proc, listening, url, lines, timeout), key, lines)
        yield server
    finally:
        _stop(proc)
        reader.join(5)
        proc.stdout.close()


def _wait_ready(proc, listening, url, lines, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    if not listening.wait(timeout) or not url:
        raise ServerFailed("mashbox did not start:\n" + "\n".join(lines[-40:]))
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerFailed("mashbox exited:\n" + "\n".join(lines[-40:]))
        try:
            with urllib.request.urlopen(url[0] + "/health", timeout=5) as r:
                if r.status == 200:
                    return url[0]
        except (urllib.error.URLError, OSError):
            pass  # 503 while loading, or not accepting yet
        time.sleep(0.1)
    raise ServerFailed("mashbox was not ready in time:\n" + "\n".join(lines[-40:]))


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
