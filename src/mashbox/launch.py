"""`mashbox run`'s first steps: refuse a keyless exposed server, resolve the model, bind the
port and spawn the engine process, then serve (serve.py). The engine process imports torch
(~1.2 s) while this one imports the server (~0.9 s: quart, hypercorn) and checks the weights,
so the server's modules are imported only once the process is spawned."""

from __future__ import annotations

import logging
import os
import socket
import sys

import trio

from . import open_files, registry
from .options import ServeOptions
from .server.security import Guard, KeyFileError, read_key_file, tenant_of_unnamed
from .worker_client import WorkerProcess

log = logging.getLogger("mashbox")

# Connections the kernel holds before they are accepted: a burst of clients past it (the
# 256-request queue filling at once) would otherwise see resets.
BACKLOG = 1024


class FatalError(Exception):
    """Stops the server with a one-line message (exit status 1)."""


def bind(host: str, port: int, stall_timeout: float) -> socket.socket:
    """Bind and listen now, so a busy port is a clear error before anything loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Second line of defence against a client that stops reading: the kernel gives up on
    # unacknowledged data (and zero-window probes) after this long; accepted sockets inherit
    # it. Twice the stall timeout, so the scheduler's own deadline frees the slot first.
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        timeout_ms = int(2 * stall_timeout * 1000)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, timeout_ms)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise FatalError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(BACKLOG)
    sock.set_inheritable(True)
    return sock


def limit_open_files() -> None:
    """As many descriptors as the system allows (open_files.py); a WARNING where that is
    still few, since each connection holds one."""
    before, after = open_files.raise_limit()
    if after > before:
        log.info("open files: up to %d (the soft limit was %d)", after, before)
    if after < open_files.LOW:
        log.warning(
            "open files: at most %d, so about that many connections at once, slow ones "
            "included; raise the hard limit (ulimit -Hn, LimitNOFILE=) to serve more",
            after,
        )


def make_guard(opts: ServeOptions) -> Guard:
    """Keys from --api-key-file and MASHBOX_API_KEY; refuse a non-loopback bind without one."""
    keys = {}
    if opts.api_key_file is not None:
        try:
            keys.update(read_key_file(opts.api_key_file))
        except KeyFileError as exc:
            raise FatalError(str(exc)) from None
    env_key = os.environ.get("MASHBOX_API_KEY", "").strip()
    if env_key:
        keys.setdefault(env_key, tenant_of_unnamed(env_key))
    guard = Guard(opts.host, keys, frozenset(h.lower() for h in opts.allowed_hosts))
    if guard.allowed_hosts and not keys:
        raise FatalError(
            "refusing --allowed-host without an API key: behind a tunnel (cloudflared, ngrok) "
            "anyone on the internet could use the server; give --api-key-file FILE or set "
            "MASHBOX_API_KEY (an ssh -L tunnel needs neither)"
        )
    if guard.keys_required and not keys:
        raise FatalError(
            f"refusing to listen on {opts.host} (not loopback) without an API key: "
            "give --api-key-file FILE or set MASHBOX_API_KEY"
        )
    return guard


def run(model: str, opts: ServeOptions) -> int:
    """Resolve, bind and serve; return the exit status."""
    try:
        guard = make_guard(opts)
        ref = registry.resolve(model)
        limit_open_files()
        sock = bind(opts.host, opts.port, opts.stall_timeout)
        # The engine process imports torch while this one imports the server and finds the
        # weights.
        worker = WorkerProcess(device=opts.device, threads=opts.threads).spawn()
        try:
            from .serve import serve  # quart, hypercorn: ~0.9 s, beside torch's import

            trio.run(serve, ref, sock, opts, guard, worker)
        finally:
            worker.stop(grace=0)  # if it never loaded (the supervisor stops one that did)
    except (FatalError, registry.ModelError) as exc:
        print(f"mashbox: error: {exc}", file=sys.stderr)
        return 1
    except BaseExceptionGroup as group:
        fatal, rest = group.split(FatalError)
        if fatal is None or rest is not None:
            raise
        print(f"mashbox: error: {_first_leaf(fatal)}", file=sys.stderr)
        return 1
    return 0


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    exc = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc
