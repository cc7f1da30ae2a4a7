"""The worker process: load the engine, then answer `Step`s over a pipe until `Shutdown`."""

from __future__ import annotations

import os
import select
import time
import traceback
from pathlib import Path

import attrs

from ..heap import freeze_heap
from ..protocol import Load, Shutdown, Step, WorkerFailed, send


def worker_main(conn, device: str, threads: int) -> None:
    """Entry point of the engine process (spawned: it imports torch, the server never does).
    It imports torch and the engine, then loads the weights of the `Load` it is sent."""
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    from .engine import Engine
    from .faults import Faults
    from .grammar_mask import GrammarMasks

    try:
        load = conn.recv()
    except (EOFError, OSError):
        return  # the server went away before it found the weights
    if not isinstance(load, Load):
        return  # Shutdown
    try:
        faults = Faults()
        masks = GrammarMasks(Path(load.path))
        engine = Engine(
            load.path,
            slots=load.slots,
            ctx=load.ctx,
            device=device,
            decode_weights=load.decode_weights,
            kv_dtype=load.kv_dtype,
            grammar_masks=masks,
            cache_dir=Path(load.cache_dir) if load.cache_dir else None,
            cache_dir_bytes=load.cache_dir_bytes,
            model_sha=load.model_sha,
        )
        engine.slow_s = faults.slow
    except Exception as exc:
        send(conn, WorkerFailed(f"cannot load {load.path}: {exc}"))
        return
    freeze_heap()
    send(conn, engine.info)
    with torch.inference_mode():  # once for every step (Engine.step)
        _serve(conn, engine, faults, when_idle=masks.read_soon)


# `when_idle`'s work starts once no step has come for IDLE_S, or IDLE_BY_S after ready. With
# 0.25 s, half the first requests sent at the first /health 200 still met the read on a
# slow host (the server's own end of loading comes between); with 1 s none did.
IDLE_S = 1.0
IDLE_BY_S = 3.0


def _serve(conn, engine, faults, when_idle=None) -> None:
    """Answer `Step`s until `Shutdown` or the server goes away. `when_idle` runs once: the
    first time no step comes for IDLE_S, or IDLE_BY_S from now under a steady load. So the
    grammars' vocabulary (qwen's 152k tokens: ~0.75 s holding the GIL) is read in a thread
    after the first answers at ready, not beside them. A constrained step that comes first
    reads it itself (GrammarMasks)."""
    idle_by = time.monotonic() + IDLE_BY_S
    # Whether a message waits, asked of one poller: Connection.poll builds a selector each
    # call, ~15 us against ~2 at every step boundary (stop 40).
    waiting = select.poll()
    waiting.register(conn.fileno(), select.POLLIN)
    held = None  # a message read early, while looking for a join
    while True:
        if when_idle is not None and held is None:
            if not waiting.poll(IDLE_S * 1000) or time.monotonic() > idle_by:
                when_idle()
                when_idle = None
        try:
            msg, held, joined = held or conn.recv(), None, False
            if isinstance(msg, Step) and waiting.poll(0):  # sent before this step started
                follow = conn.recv()
                if isinstance(follow, Step) and follow.joins == msg.index:
                    msg, joined = msg.with_join(follow), True
                else:
                    held = follow
        except (EOFError, OSError):
            return  # the server went away
        if isinstance(msg, Shutdown):
            return
        assert isinstance(msg, Step), type(msg)
        try:
            faults.before_step(msg.index, (t for p in msg.prefills for t in p.token_ids))
            result = engine.step(msg)
            send(conn, attrs.evolve(result, joined=True) if joined else result)
        except Exception:
            send(conn, WorkerFailed(traceback.format_exc(limit=8)))
            os._exit(1)  # state may be half-written: the supervisor starts a fresh worker
