"""Start a real `mashbox run` process on a free port and wait until it answers."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

_LISTENING = re.compile(r"listening on (http://\S+)")


class ServerProcess:
    """A `mashbox run` subprocess; its log lines are kept for assertions and failures."""

    def __init__(
        self,
        model: str,
        *args: str,
        env: dict | None = None,
        log: Path | None = None,
        launcher: Path | None = None,
    ):
        """launcher: a script that runs mashbox's CLI in place of `python -m mashbox.cli`."""
        cli = [str(launcher)] if launcher else ["-m", "mashbox.cli"]
        cmd = [sys.executable, *cli, "run", model, "--port", "0", *args]
        self.lines: list[str] = []
        self._listening = threading.Event()
        self.url: str | None = None
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self._log = open(log, "w") if log else None  # noqa: SIM115 (closed in stop)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if self._log:
                self._log.write(line)
                self._log.flush()
            m = _LISTENING.search(line)
            if m and self.url is None:
                self.url = m.group(1)
                self._listening.set()
        self._listening.set()

    def wait_listening(self, timeout: float = 60) -> str:
        if not self._listening.wait(timeout) or self.url is None:
            raise RuntimeError("server did not start:\n" + self.output())
        return self.url

    def wait_ready(self, timeout: float = 600) -> str:
        """The server's URL once /health answers 200. One that never does is stopped, not
        left running past its test (a helper that raised here leaked its server)."""
        try:
            return self._ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _ready(self, timeout: float) -> str:
        url = self.wait_listening(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited:\n" + self.output())
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    return url
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError("server not ready in time:\n" + self.output())

    def output(self) -> str:
        return "\n".join(self.lines[-60:])

    def wait_exit(self, timeout: float = 60) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(5)  # the reader has taken the last lines
        return code

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._reader.join(5)
        self.proc.stdout.close()
        if self._log:
            self._log.close()
        return self.proc.returncode


@contextlib.contextmanager
def serving(model: str, *args: str, timeout: float = 120, **kwargs):
    """A ready `mashbox run` (ServerProcess's arguments), stopped however the block ends."""
    proc = ServerProcess(model, *args, **kwargs)
    try:
        proc.wait_ready(timeout)
        yield proc
    finally:
        proc.stop()


def wait_for(predicate, timeout: float, interval: float = 0.02):
    """Poll until predicate() is truthy; return its value, or fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s")
