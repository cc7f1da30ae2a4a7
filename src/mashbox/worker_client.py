"""The server's side of the engine worker process: start it, step it, stop it."""

from __future__ import annotations

import multiprocessing
import os

import trio

from .engine.worker import worker_main
from .protocol import EngineInfo, Shutdown, Step, StepResult, WorkerFailed


class WorkerError(Exception):
    """The worker process died, failed to load, or failed a step."""


class WorkerProcess:
    """One engine process behind a pipe; the scheduler is its only caller."""

    def __init__(self, path, *, slots: int, ctx: int, device: str, threads: int):
        self._args = (str(path), slots, ctx, device, threads)
        self._conn = None
        self._process = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    async def start(self) -> EngineInfo:
        """Spawn the process and wait until its model is loaded."""
        ctx = multiprocessing.get_context("spawn")  # never fork a process that runs trio
        parent, child = ctx.Pipe()
        self._process = ctx.Process(
            target=worker_main, args=(child, *self._args), name="mashbox-engine", daemon=True
        )
        await trio.to_thread.run_sync(self._process.start)
        child.close()
        self._conn = parent
        info = await self._receive()
        if not isinstance(info, EngineInfo):
            raise WorkerError(f"unexpected worker reply {info!r}")
        return info

    async def step(self, step: Step) -> StepResult:
        """Send one step and wait for its result without blocking the event loop."""
        try:
            self._conn.send(step)
        except OSError as exc:
            raise WorkerError(f"worker pipe closed: {exc}") from exc
        result = await self._receive()
        if not isinstance(result, StepResult):
            raise WorkerError(f"unexpected worker reply {result!r}")
        return result

    async def _receive(self):
        await trio.lowlevel.wait_readable(self._conn.fileno())
        try:
            msg = self._conn.recv()
        except (EOFError, OSError) as exc:
            code = self._process.exitcode if self._process else None
            raise WorkerError(f"worker exited (code {code})") from exc
        if isinstance(msg, WorkerFailed):
            raise WorkerError(msg.message)
        return msg

    def kill(self) -> None:
        """Stop the process now (used on shutdown and after a fault)."""
        if self._conn is not None:
            try:
                self._conn.send(Shutdown())
            except OSError:
                pass
            self._conn.close()
            self._conn = None
        if self._process is not None and self._process.is_alive():
            self._process.join(timeout=2)
            if self._process.is_alive():
                os.kill(self._process.pid, 9)
                self._process.join(timeout=2)
