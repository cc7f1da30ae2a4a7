"""The transport's stall clock (server/connections.py) on real loopback TCP connections with
the kernel's default buffers: a peer that takes nothing is cut on time, one that reads slowly
or has nothing waiting for it never is. The server-wide behaviour is in test_concurrency."""

from __future__ import annotations

import contextlib
import socket
import sys
import time

import pytest
import trio

from mashbox.server import connections

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="TCP_INFO's byte counts are Linux's"
)

TIMEOUT = 1.0


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """(server side, client side) of a loopback connection, default buffers."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    return server, client


def test_this_linux_reports_acknowledged_bytes():
    # The fast path: a Linux this suite runs on has TCP_INFO's byte counts (4.6+).
    server, client = tcp_pair()
    with server, client:
        server.sendall(b"x" * 1000)
        time.sleep(0.1)
        assert connections.transport_progress(server) == (1000, False)


def test_a_socket_that_cannot_say_is_left_to_the_scheduler_clock():
    # Not TCP: no acknowledged bytes to read, so no watch (the scheduler's clock remains).
    a, b = socket.socketpair()
    with a, b:
        assert connections.transport_progress(a) is None
        assert trio.run(connections.watch, trio.socket.from_stdlib_socket(a), TIMEOUT) is False


async def _write_until_broken(sock, chunk=b"y" * 4096):
    try:
        while True:
            await sock.send(chunk)
    except OSError:
        return


async def test_a_peer_that_takes_nothing_is_cut_after_the_timeout():
    server, client = tcp_pair()
    with client:
        sock = trio.socket.from_stdlib_socket(server)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_write_until_broken, sock)
            t0 = trio.current_time()
            assert await connections.watch(sock, TIMEOUT)
            elapsed = trio.current_time() - t0
        # The window closed within a few ms of the first write; the cut is within one look.
        assert TIMEOUT <= elapsed < TIMEOUT + connections.watch_interval(TIMEOUT) + 0.3
        sock.close()  # as hypercorn does once its send failed: the kernel resets
        with pytest.raises(ConnectionResetError):
            while client.recv(1 << 20):
                pass


async def test_a_slow_reader_and_an_idle_peer_are_never_cut():
    server, client = tcp_pair()
    client.setblocking(False)
    with client:
        sock = trio.socket.from_stdlib_socket(server)

        async def read_slowly():
            # Slower than the writer, for four times the timeout. Linux reopens a closed
            # window only once a whole MSS (64 KB on loopback) is free, so a reader must
            # take that much within the timeout to count as reading: 16 KB every 50 ms.
            for _ in range(80):
                await trio.sleep(0.05)
                try:
                    client.recv(16384)
                except BlockingIOError:
                    pass

        async with trio.open_nursery() as nursery:
            nursery.start_soon(_write_until_broken, sock)
            nursery.start_soon(read_slowly)
            with trio.move_on_after(4.0) as scope:
                await connections.watch(sock, TIMEOUT)
            assert scope.cancelled_caught, "a reading peer was cut"
            nursery.cancel_scope.cancel()

        while connections.transport_progress(sock)[1]:  # drain: then nothing waits for it
            with contextlib.suppress(BlockingIOError):
                client.recv(1 << 20)
            await trio.sleep(0.01)
        with trio.move_on_after(3 * TIMEOUT) as scope:
            await connections.watch(sock, TIMEOUT)
        assert scope.cancelled_caught, "an idle connection was cut"
        sock.close()
