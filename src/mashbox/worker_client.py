"""The server's side of the engine worker process: start it, step it, restart it; and
`EngineLink`, what the scheduler asks of any engine it steps."""

from __future__ import annotations

import collections
import logging
import multiprocessing
from typing import Protocol

import attrs
import trio

from .engine.worker import worker_main
from .protocol import EngineInfo, Load, Shutdown, Step, StepResult, WorkerFailed, send


class WorkerError(Exception):
    """The worker process died, failed to load, or failed a step."""


class StepTimeout(WorkerError):
    """A step took longer than the step timeout: the engine counts as hung."""


class EngineLink(Protocol):
    """What the scheduler needs of an engine: steps in, their results out in the order sent,
    and a fresh engine after a fault. `Supervisor` is the server's (a worker process); the
    tests step an engine in their own process."""

    ready: bool  # it takes steps (not while loading or restarting)

    def send(self, step: Step) -> None:
        """Queue a step without waiting for it to run; steps run in the order sent."""
        ...

    async def receive(self) -> StepResult:
        """The oldest sent step's result; WorkerError if the engine failed it (or hung)."""
        ...

    async def restart(self) -> None:
        """A new engine after a WorkerError: no step sent before runs, every cache is empty."""
        ...


class WorkerProcess:
    """One engine process behind a pipe; the scheduler is its only caller."""

    def __init__(self, *, device: str = "cpu", threads: int = 0):
        self._device, self._threads = device, threads
        self._conn = None
        self._process = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def spawn(self) -> WorkerProcess:
        """Start the process, which imports torch and the engine (~1.3 s) and then waits for
        what to load. It blocks for the spawn's few ms: off the event loop once one runs."""
        ctx = multiprocessing.get_context("spawn")  # never fork a process that runs trio
        parent, child = ctx.Pipe()
        self._process = ctx.Process(
            target=worker_main,
            args=(child, self._device, self._threads),
            name="mashbox-engine",
            daemon=True,
        )
        self._process.start()
        child.close()
        self._conn = parent
        return self

    async def load(self, load: Load) -> EngineInfo:
        """Have the process (spawned now if it was not) load the weights; wait until it has."""
        if self._process is None:
            await trio.to_thread.run_sync(self.spawn)
        try:
            send(self._conn, load)
        except OSError as exc:
            raise WorkerError(f"worker pipe closed: {exc}") from exc
        info = await self._receive()
        if not isinstance(info, EngineInfo):
            raise WorkerError(f"unexpected worker reply {info!r}")
        return info

    def send(self, step: Step) -> None:
        """Queue a step in the pipe; the worker runs steps in the order they are sent.

        Only a step sent while another runs can wait here for pipe space: the scheduler
        sends such steps (decodes only) small."""
        try:
            send(self._conn, step)
        except OSError as exc:
            raise WorkerError(f"worker pipe closed: {exc}") from exc

    async def receive(self) -> StepResult:
        """The result of the oldest step sent, without blocking the event loop."""
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

    def stop(self, *, grace: float = 2.0) -> None:
        """Ask the process to exit, then kill it if it has not within `grace` seconds."""
        if self._conn is not None:
            try:
                send(self._conn, Shutdown())
            except OSError:
                pass
            self._conn.close()
            self._conn = None
        if self._process is not None:
            if grace > 0:
                self._process.join(timeout=grace)
            if self._process.is_alive():
                self._process.kill()  # a hung or busy step never reads Shutdown
            self._process.join(timeout=5)


log = logging.getLogger("mashbox")


@attrs.frozen
class SupervisorStatistics:
    """The engine process at one moment (/health, /metrics)."""

    ready: bool
    pid: int | None
    restarts: int
    compiles_after_ready: int  # across every worker process this server started
    info: EngineInfo | None  # what the engine said when it last loaded


class Supervisor(EngineLink):
    """Keeps one engine process running: a fault or a step past its deadline gets a fresh one.

    The scheduler is its only caller: `receive` raises WorkerError, then the scheduler decides
    what happens to each request and calls `restart`.
    """

    def __init__(self, new_worker, load: Load, *, step_timeout: float = 120.0):
        self._new_worker = new_worker  # () -> WorkerProcess (not spawned)
        self._load = load
        self.step_timeout = step_timeout
        self.worker: WorkerProcess | None = None
        self.info: EngineInfo | None = None
        self.ready = False
        self.restarts = 0
        self.compiles_after_ready = 0  # across every worker process this server started
        self._compiles_seen = 0
        self._runs = collections.deque()  # each step sent and not answered: its runs

    @property
    def pid(self) -> int | None:
        return self.worker.pid if self.worker else None

    def statistics(self) -> SupervisorStatistics:
        """The engine process, now (a frozen snapshot)."""
        return SupervisorStatistics(
            self.ready, self.pid, self.restarts, self.compiles_after_ready, self.info
        )

    async def start(self, worker: WorkerProcess | None = None) -> EngineInfo:
        """Load the weights in `worker` (one spawned ahead), else in a new process."""
        self._runs.clear()  # a new worker never runs what the old one was sent
        self.worker = worker or self._new_worker()
        self.info = await self.worker.load(self._load)
        self._compiles_seen = self.info.compiles
        self.ready = True
        return self.info

    def send(self, step: Step) -> None:
        self.worker.send(step)
        self._runs.append(step.repeat)

    async def receive(self) -> StepResult:
        """The oldest sent step's result under the watchdog deadline (counted from when the
        worker could start it: the step before's result, or now; a repeated step has it for
        each run): a hung engine is a fault, not a wait."""
        runs = self._runs.popleft() if self._runs else 1
        with trio.move_on_after(self.step_timeout * runs):
            result = await self.worker.receive()
            if result.joined and self._runs:  # its join came back with it
                self._runs.popleft()
            self.compiles_after_ready += result.compiles - self._compiles_seen
            self._compiles_seen = result.compiles
            return result
        raise StepTimeout(f"an engine step took longer than {self.step_timeout:g} s")

    async def restart(self) -> None:
        """Replace the worker; keep trying (health says loading meanwhile)."""
        self.ready = False
        self.restarts += 1
        if self.worker is not None:
            await trio.to_thread.run_sync(lambda: self.worker.stop(grace=0))
        delay = 0.5
        while True:
            try:
                await self.start()
                log.info("engine process restarted (pid %s)", self.pid)
                return
            except WorkerError as exc:
                log.error("engine restart failed: %s; retrying in %.1f s", exc, delay)
                await trio.sleep(delay)
                delay = min(delay * 2, 30.0)

    def stop(self) -> None:
        self.ready = False
        if self.worker is not None:
            self.worker.stop()
