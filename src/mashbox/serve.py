"""`mashbox run`, once bound (launch.py): load the model in the worker process spawned, serve
until a signal."""

from __future__ import annotations

import logging
import signal
import socket
import time
from functools import partial
from pathlib import Path

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

from . import registry
from .heap import freeze_heap
from .launch import BACKLOG, FatalError
from .memory import host_cache_cap, memory_available
from .options import ServeOptions
from .prompt_cache import PromptCache
from .protocol import Load
from .scheduler import Scheduler
from .server import chat_ws, connections
from .server.app import Drain, RefuseBadHost, RefuseWhileDraining, ShieldFinalSend, create_app
from .server.identity import model_identity, weights_sha
from .server.security import Guard
from .server.state import Loaded, ServerState
from .text.chat_template import ChatTemplate
from .text.tokenizer import Tokenizer
from .worker_client import Supervisor, WorkerError, WorkerProcess

log = logging.getLogger("mashbox")


def tenant_slots(opts: ServeOptions, guard: Guard) -> int:
    """Slots one tenant may hold at once: --tenant-slots, else an equal share of the slots
    among the tenants the keys name (all of them without keys, or with one tenant); 0 = all."""
    if opts.tenant_slots is not None:
        return opts.tenant_slots
    tenants = len(set(guard.keys.values())) or 1
    return -(-opts.slots // tenants)


def load_text(path: Path) -> tuple[Tokenizer, ChatTemplate]:
    """The tokenizer and the chat template."""
    tok = Tokenizer.for_model(path)
    return tok, ChatTemplate(tok.chat_template, bos_token=tok.bos_token, eos_token=tok.eos_token)


class _Progress:
    """Log download/verify progress at most twice a second."""

    def __init__(self):
        self.t0 = time.monotonic()
        self.last = 0.0

    def __call__(self, done: int, total: int | None, message: str) -> None:
        now = time.monotonic()
        if now - self.last < 0.5 and (total is None or done < total):
            return
        self.last = now
        size = f"{done / 1e6:.1f}/{total / 1e6:.1f} MB" if total else f"{done / 1e6:.1f} MB"
        log.info("%s: %s (%.1f s)", message, size, now - self.t0)


async def serve(
    ref: registry.ModelRef,
    sock: socket.socket,
    opts: ServeOptions,
    guard: Guard,
    worker: WorkerProcess,
) -> None:
    """Serve `ref` on the bound socket until SIGINT or SIGTERM, its engine in `worker` (spawned
    ahead: it imports torch meanwhile)."""
    state = ServerState(model_id=ref.id, ctx=opts.ctx or 0, slots=opts.slots, guard=guard)
    host, port = sock.getsockname()[:2]
    config = Config()
    # Hypercorn's own socket object owns the descriptor from here on: ours, still holding it,
    # would close it again when collected, after its number was reused (by a file opened at
    # exit, say, which then lost its writes).
    config.bind = [f"fd://{sock.detach()}"]
    config.backlog = BACKLOG  # hypercorn listens again on the socket, with its own 100
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.keep_alive_timeout = opts.keep_alive
    config.websocket_max_message_size = chat_ws.MAX_MESSAGE_BYTES
    chat_ws.install_bounded_deflate()
    config.graceful_timeout = 3
    connections.install(opts.stall_timeout)
    drain = Drain()
    app = create_app(state, ui=opts.ui, drain=drain)
    if opts.vllm_metrics:
        state.metrics.export_vllm_names()
    app = ShieldFinalSend(RefuseBadHost(RefuseWhileDraining(app, drain)))
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    stop_accepting = trio.Event()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                _shut_down_on_signal,
                state,
                drain,
                opts.drain_timeout,
                stop_accepting,
                nursery.cancel_scope,
            )
            await nursery.start(
                partial(hypercorn_serve, app, config, shutdown_trigger=stop_accepting.wait)
            )
            log.info("listening on %s (loading %s)", url, ref.id)
            if opts.ui:
                log.info("chat page: %s/", url)
            await _load(state, ref, opts, nursery, worker)
            log.info("point clients at %s/v1 (OpenAI) or %s (Anthropic)", url, url)
    finally:
        if state.supervisor is not None:
            state.supervisor.stop()


async def _load(
    state: ServerState,
    ref,
    opts: ServeOptions,
    nursery: trio.Nursery,
    worker: WorkerProcess,
) -> None:
    """Fetch the weights, load them in `worker`, start the scheduler."""
    t0 = time.monotonic()
    models_dir = opts.models_dir or registry.default_models_dir()
    try:
        path = await trio.to_thread.run_sync(
            partial(registry.fetch, ref, models_dir, progress=_Progress())
        )
    except registry.ModelError as exc:
        raise FatalError(str(exc)) from None

    weights = weights_sha(path, ref.entry)
    load = Load(
        str(path),
        slots=opts.slots,
        ctx=opts.ctx or 0,
        decode_weights=opts.decode_weights,
        kv_dtype=opts.kv_dtype,
        cache_dir=str(opts.cache_dir) if opts.cache_dir is not None else None,
        cache_dir_bytes=opts.cache_dir_mib * 2**20,
        model_sha=weights,
    )
    supervisor = Supervisor(
        partial(WorkerProcess, device=opts.device, threads=opts.threads),
        load,
        step_timeout=opts.step_timeout,
    )
    state.supervisor = supervisor
    # Parse the vocabulary here while the engine process loads the weights.
    async with trio.open_nursery() as loading:
        text = []
        loading.start_soon(_append_result, text, trio.to_thread.run_sync, load_text, path)
        try:
            info = await supervisor.start(worker)
        except WorkerError as exc:
            raise FatalError(str(exc)) from None
    ((tokenizer, template),) = text
    state.ctx = info.ctx
    identity = model_identity(ref.id, weights, tokenizer, template, info, opts.slots)
    cache = PromptCache(
        _host_cache_bytes(opts, info), info.kv_bytes_per_token, identity.cache_namespace
    )
    if opts.cache_dir is not None:
        cache.use_disk(opts.cache_dir_mib * 2**20, info.disk_key, info.disk_entries)
        log.info("prompt cache on disk: %s, %d prefixes", opts.cache_dir, len(info.disk_entries))
    scheduler = Scheduler(
        tokenizer,
        supervisor,
        slots=opts.slots,
        ctx=info.ctx,
        prefill_chunk=opts.prefill_chunk,
        stall_timeout=opts.stall_timeout,
        observer=state.metrics,
        prompt_cache=cache,
        tenant_slots=tenant_slots(opts, state.guard),
        decode_burst=opts.decode_burst_ms / 1000,
    )
    state.loaded = Loaded(path.name, tokenizer, template, identity, scheduler)
    freeze_heap()  # as the engine process does: no full collection walks the loaded server
    nursery.start_soon(scheduler.run)
    if info.kernels_fallback:
        log.warning(
            "WARNING: decode runs on torch's float ops, several times slower: mashbox's CPU "
            "kernels are unavailable: %s. Run `mashbox kernels` to see each target tried.",
            info.kernels_fallback,
        )
    log.info(
        "ready in %.1f s: %s (%s, %.0fM params, %s on %s, %.2f GB of weights held), decode %s, "
        "%d slots x %d tokens of %s KV, host prompt cache %d MiB",
        time.monotonic() - t0,
        ref.id,
        info.arch,
        info.n_params / 1e6,
        info.dtype,
        info.device,
        info.held_bytes / 1e9,
        info.decode,
        opts.slots,
        info.ctx,
        info.kv_dtype,
        cache.cap_bytes // 2**20,
    )


def _host_cache_bytes(opts: ServeOptions, info) -> int:
    """--cache-ram's bytes, or less where the machine could not hold them beside a full KV
    cache (on the CPU its pages are taken as slots fill), said loudly."""
    asked = opts.cache_ram_mib * 2**20
    kv = opts.slots * info.ctx * info.kv_bytes_per_token if info.device == "cpu" else 0
    available = memory_available()
    cap = host_cache_cap(asked, available, kv)
    if cap < asked:
        log.warning(
            "WARNING: the RAM prompt cache holds at most %d MiB, not --cache-ram's %d: this "
            "machine has %.1f GB available, %.1f GB of it for the KV cache as slots fill, and "
            "the prompt cache takes at most half of the rest",
            cap // 2**20,
            opts.cache_ram_mib,
            available / 1e9,
            kv / 1e9,
        )
    return cap


async def _append_result(out: list, fn, *args) -> None:
    out.append(await fn(*args))


async def _shut_down_on_signal(
    state: ServerState,
    drain: Drain,
    drain_timeout: float,
    stop_accepting: trio.Event,
    scope: trio.CancelScope,
) -> None:
    """SIGINT/SIGTERM: end every request with an error event, stop accepting, then exit.
    With --drain-timeout, SIGTERM first drains: new requests get 503 (and /health says so, so
    a router moves traffic) while the ones taken run to their end, up to that many seconds."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            if signum == signal.SIGTERM and drain_timeout > 0:
                await _drain(drain, drain_timeout, signals)
            log.info("%s: shutting down", signal.Signals(signum).name)
            if state.scheduler is not None:
                state.scheduler.close()
            stop_accepting.set()
            # Handlers now write their error events; give them a moment, then end every task.
            await trio.sleep(0.5)
            scope.cancel()
            return


async def _drain(drain: Drain, timeout: float, signals) -> None:
    """Refuse new work until the requests taken have ended, `timeout` seconds have passed or
    a second signal comes (SIGINT, or another SIGTERM: stop now)."""
    drain.start()
    log.info(
        "SIGTERM: draining: new requests get 503; %d running may take up to %g s",
        drain.in_flight,
        timeout,
    )
    with trio.move_on_after(timeout) as deadline:
        async with trio.open_nursery() as nursery:

            async def first_of(wait) -> None:
                await wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(first_of, drain.wait_idle)
            nursery.start_soon(first_of, signals.__anext__)
    if deadline.cancelled_caught and drain.in_flight:
        log.info("drain: %d requests still running after %g s", drain.in_flight, timeout)
