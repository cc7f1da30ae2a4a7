"""Structured concurrency that holds: cancellation, stalled readers, engine faults, queue
limits, connections and shutdown, each against a real `mashbox run` and engine process."""

from __future__ import annotations

import fcntl
import json
import re
import signal
import socket
import struct
import termios
import time
from functools import partial

import httpx
import pytest
import trio

from support import rawhttp
from support.serverproc import ServerProcess, serving, wait_for

CHAT = "/v1/chat/completions"


def chat_body(content="Tell me a story.", **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], **extra}


def health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=10).json()


@pytest.fixture(scope="module")
def slow_server(tiny_llama, tmp_path_factory):
    """One slot, 20 ms engine steps, small prefill chunks, short stall and keep-alive."""
    with serving(
        str(tiny_llama),
        "--ctx", "2048", "--slots", "1", "--prefill-chunk", "8", "--stall-timeout", "2",
        "--keep-alive", "1", "--threads", "1",
        env={"MASHBOX_FAULTS": "slow=0.02"},
        log=tmp_path_factory.mktemp("slow") / "server.log",
    ) as proc:  # fmt: skip
        yield proc


def start_fault_server(model, faults: str, *args) -> ServerProcess:
    proc = ServerProcess(
        str(model), "--ctx", "256", "--slots", "2", "--threads", "1", *args,
        env={"MASHBOX_FAULTS": faults},
    )  # fmt: skip
    proc.wait_ready(120)
    return proc


# --- exact cancellation --------------------------------------------------------------------


def test_disconnect_mid_decode_frees_the_slot_at_once(slow_server):
    url = slow_server.url
    sock = rawhttp.connect(url)
    rawhttp.post_json(sock, CHAT, chat_body(max_tokens=1500, ignore_eos=True, stream=True))
    rawhttp.read_until(sock, b'"content": "')  # decoding has begun
    assert health(url)["live_rows"] == 1
    sock.close()
    t0 = time.monotonic()
    wait_for(lambda: health(url)["live_rows"] == 0, timeout=1.0)
    assert time.monotonic() - t0 < 1.0  # 1500 steps of 20 ms would take 30 s


def test_disconnect_mid_prefill_frees_the_slot(slow_server):
    url = slow_server.url
    long_prompt = "Paris is the capital of France. " * 60  # ~400 tokens: 50 chunks of 8
    sock = rawhttp.connect(url)
    rawhttp.post_json(sock, "/v1/completions", {"prompt": long_prompt, "max_tokens": 5})
    wait_for(lambda: health(url)["live_rows"] == 1, timeout=5)
    sock.close()
    wait_for(lambda: health(url)["live_rows"] == 0, timeout=1.0)
    # The slot really is free: a new request runs at once.
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
    assert r.json()["timings"]["queue_ms"] < 500


def decision_body(state="A support ticket.") -> dict:
    questions = {"q": {"type": "noul", "instructions": "Is it urgent?"}}
    return {"model": "jev-latest", "state": state, "questions": questions}


def test_disconnect_mid_decision_frees_the_slot(slow_server):
    url = slow_server.url
    sock = rawhttp.connect(url)
    rawhttp.post_json(sock, "/v1/systemone", decision_body("Paris is in France. " * 60))
    wait_for(lambda: health(url)["live_rows"] == 1, timeout=5)
    sock.close()
    wait_for(lambda: health(url)["live_rows"] == 0, timeout=1.0)
    r = httpx.post(url + "/v1/systemone", json=decision_body(), timeout=30)
    assert r.status_code == 200


def test_disconnect_while_queued_frees_the_queue_place(slow_server):
    url = slow_server.url
    running = rawhttp.connect(url)
    rawhttp.post_json(running, CHAT, chat_body(max_tokens=1500, ignore_eos=True, stream=True))
    rawhttp.read_until(running, b'"content": "')
    queued = rawhttp.connect(url)
    rawhttp.post_json(queued, CHAT, chat_body(max_tokens=5))
    wait_for(lambda: health(url)["waiting"] == 1, timeout=5)
    queued.close()
    wait_for(lambda: health(url)["waiting"] == 0, timeout=1.0)
    assert health(url)["live_rows"] == 1
    running.close()
    wait_for(lambda: health(url)["live_rows"] == 0, timeout=1.0)


# --- stalled and slow readers --------------------------------------------------------------


def test_a_reader_that_reads_nothing_is_dropped(slow_server):
    url = slow_server.url
    sock = rawhttp.connect(url, rcvbuf=4096)
    rawhttp.post_json(sock, CHAT, chat_body(max_tokens=1900, ignore_eos=True, stream=True))
    wait_for(lambda: health(url)["live_rows"] == 1, timeout=5)
    # A 4 KB receive buffer fills at once: the transport's clock cuts the connection two
    # seconds later (test_scheduler proves the scheduler's own clock, for transports that
    # cannot say, alone)...
    t0 = time.monotonic()
    wait_for(lambda: health(url)["live_rows"] == 0, timeout=20, interval=0.2)
    assert time.monotonic() - t0 < 10  # 1900 steps of 20 ms would take 38 s
    # ...and the stream ends.
    _, closed = rawhttp.read_to_eof(sock, timeout=20)
    assert closed
    sock.close()


@pytest.fixture(scope="module")
def stall_server(tiny_llama, tmp_path_factory):
    """One slot, 3 ms engine steps (~300 tokens a second, ~3 to an event: --decode-burst's
    default), a long context and the default 30 s stall timeout."""
    with serving(
        str(tiny_llama), "--ctx", "32768", "--slots", "1", "--threads", "1",
        env={"MASHBOX_FAULTS": "slow=0.003"},
        log=tmp_path_factory.mktemp("stall") / "server.log",
    ) as proc:  # fmt: skip
        yield proc


def _queued(sock: socket.socket) -> int:
    """Bytes the kernel holds for this socket, unread."""
    return struct.unpack("i", fcntl.ioctl(sock, termios.FIONREAD, b"\0" * 4))[0]


def test_a_reader_that_stops_is_cut_at_30_s_with_default_buffers(stall_server):
    # Seed 000: "A client that reads nothing from the stream for 30 s is disconnected and its
    # answer stops." Default socket buffers on both ends: the client takes nothing at all.
    # Its kernel accepts bytes until its window closes (~100 KB here), the server's kernel
    # would queue 4 MB more, and the answer would run for two minutes: the cut comes 30 s
    # after the connection stopped taking bytes, not after all of that.
    url = stall_server.url
    sock = rawhttp.connect(url)
    t0 = time.monotonic()
    rawhttp.post_json(sock, CHAT, chat_body(max_tokens=32000, ignore_eos=True, stream=True))
    queued, t_full = 0, t0
    while health(url)["live_rows"] == 1:
        if (now := _queued(sock)) != queued:
            queued, t_full = now, time.monotonic()
        assert time.monotonic() - t0 < 50, "the stalled reader was never cut"
        time.sleep(0.1)
    t_cut = time.monotonic()
    # (Each event carries ~3 tokens here, --decode-burst: fewer bytes a token than one each.)
    assert t_full - t0 < 10, f"the client's kernel took bytes for {t_full - t0:.1f} s"
    stalled = t_cut - t_full
    assert 28 <= stalled <= 32, f"cut {stalled:.1f} s after the client's kernel was full"

    def cuts() -> list[float]:
        found = [re.search(r"client took nothing for ([\d.]+) s", s) for s in stall_server.lines]
        return [float(m.group(1)) for m in found if m]

    wait_for(lambda: cuts(), timeout=5)  # the log line may trail the freed slot a little
    assert [30 <= silence <= 32 for silence in cuts()] == [True]  # one cut, on time
    _, closed = rawhttp.read_to_eof(sock, timeout=5)  # queued events, then the reset
    assert closed
    sock.close()


def test_a_slow_but_reading_client_is_never_cut(slow_server):
    url = slow_server.url
    sock = rawhttp.connect(url, rcvbuf=4096)
    rawhttp.post_json(sock, CHAT, chat_body(max_tokens=400, ignore_eos=True, stream=True))
    data = b""
    t0 = time.monotonic()
    while b"data: [DONE]" not in data:
        time.sleep(0.5)  # behind the engine, but never 2 s without reading
        chunk = sock.recv(65536)
        assert chunk, "the server closed a reading client's stream"
        data += chunk
    assert time.monotonic() - t0 > 4.0  # it took longer than twice the stall timeout
    assert b'"finish_reason": "length"' in data
    sock.close()


# --- queue limits --------------------------------------------------------------------------


async def test_32_waiting_then_429_with_retry_after(slow_server):
    url = slow_server.url
    holder = rawhttp.connect(url)
    rawhttp.post_json(holder, CHAT, chat_body(max_tokens=1500, ignore_eos=True, stream=True))
    rawhttp.read_until(holder, b'"content": "')
    statuses, retry_after = [], []
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:

        async def one(i):
            r = await http.post(CHAT, json=chat_body(f"q{i}", max_tokens=1))
            statuses.append(r.status_code)
            if r.status_code == 429:
                retry_after.append(r.headers.get("Retry-After"))
                assert r.json()["error"]["type"] == "rate_limit_error"

        async with trio.open_nursery() as nursery:
            for i in range(40):
                nursery.start_soon(one, i)
            await trio.sleep(1.0)
            assert health(url)["waiting"] == 32
            # The same bound on the Anthropic route, in its shape.
            m = await http.post("/v1/messages", json=chat_body(max_tokens=1))
            assert m.status_code == 429 and m.headers["Retry-After"]
            assert m.json()["error"]["type"] == "rate_limit_error"
            # And on /v1/systemone, in seed 004's shape: 529 overloaded.
            d = await http.post("/v1/systemone", json=decision_body())
            assert d.status_code == 529 and int(d.headers["Retry-After"]) >= 1
            assert d.json()["error"]["code"] == "overloaded"
            holder.close()  # the slot frees; the 32 run one by one
    assert statuses.count(429) == 8
    assert statuses.count(200) == 32
    assert all(value and int(value) >= 1 for value in retry_after)
    assert health(url)["waiting"] == 0


# --- connections ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
        b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n",
    ],
    ids=["connection-close", "http-1.0"],
)
def test_connections_that_should_close_do(slow_server, request_bytes):
    sock = rawhttp.connect(slow_server.url)
    sock.sendall(request_bytes)
    data, closed = rawhttp.read_to_eof(sock, timeout=5)
    assert closed and b" 200 " in data.split(b"\r\n")[0]
    sock.close()


def test_idle_keep_alive_connections_are_closed(slow_server):
    sock = rawhttp.connect(slow_server.url)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    first = rawhttp.read_until(sock, b"}")
    assert b" 200 " in first.split(b"\r\n")[0]
    t0 = time.monotonic()
    _, closed = rawhttp.read_to_eof(sock, timeout=5)
    assert closed and time.monotonic() - t0 < 4  # --keep-alive 1
    sock.close()


def test_streamed_post_with_connection_close_ends(slow_server):
    sock = rawhttp.connect(slow_server.url)
    body = json.dumps(chat_body(max_tokens=3, stream=True)).encode()
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    data, closed = rawhttp.read_to_eof(sock, timeout=10)
    assert closed and b"data: [DONE]" in data
    sock.close()


# --- engine faults -------------------------------------------------------------------------

# Long enough that step 6 comes mid-answer even where decode steps repeat (--decode-burst:
# up to 8 tokens a step on the tiny model).
SEEDED = chat_body("Write about Paris.", temperature=1.0, seed=42, max_tokens=60, ignore_eos=True)


@pytest.fixture(scope="module")
def reference_text(tiny_llama):
    """The seeded answer from a server that never faults."""
    proc = start_fault_server(tiny_llama, "")
    try:
        r = httpx.post(proc.url + CHAT, json=SEEDED, timeout=60).json()
        return r["choices"][0]["message"]["content"]
    finally:
        proc.stop()


@pytest.mark.parametrize("fault", ["crash@1", "raise@1", "crash@6", "raise@6"])
def test_a_non_streamed_request_runs_again_after_a_fault(tiny_llama, reference_text, fault):
    proc = start_fault_server(tiny_llama, fault)
    try:
        r = httpx.post(proc.url + CHAT, json=SEEDED, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == reference_text
        h = health(proc.url)
        assert h["worker_restarts"] == 1 and h["status"] == "ok"
    finally:
        assert proc.stop() == 0


def test_a_stream_with_no_output_yet_runs_again(tiny_llama, reference_text):
    proc = start_fault_server(tiny_llama, "crash@1")
    try:
        # With usage in every chunk: the count the answer started again with is its own.
        options = {"continuous_usage_stats": True}
        body = {**SEEDED, "stream": True, "stream_options": options}
        r = httpx.post(proc.url + CHAT, json=body, timeout=120)
        events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
        assert text == reference_text
        assert r.text.rstrip().endswith("data: [DONE]")
        counts = [e["usage"]["completion_tokens"] for e in events]
        assert counts == sorted(counts) and counts[-1] == SEEDED["max_tokens"]
    finally:
        proc.stop()


def test_a_stream_that_has_sent_output_ends_with_an_error_event(tiny_llama):
    proc = start_fault_server(tiny_llama, "crash@6")
    try:
        r = httpx.post(proc.url + CHAT, json={**SEEDED, "stream": True}, timeout=120)
        events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
        assert any(e.get("choices") and e["choices"][0]["delta"].get("content") for e in events)
        error = events[-1]["error"]
        assert error["type"] == "server_error"
        assert error["request_id"] == events[0]["id"]
        assert "[DONE]" not in r.text
        # The server carries on with a fresh engine.
        wait_for(lambda: health(proc.url)["status"] == "ok", timeout=60, interval=0.1)
        assert httpx.post(proc.url + CHAT, json=SEEDED, timeout=60).status_code == 200
    finally:
        proc.stop()


def test_a_responses_stream_that_has_sent_output_ends_with_error_then_response_failed(
    tiny_llama,
):
    """Seed 000: "An error after the stream started is sent as event `error`, then
    `response.failed` (the response with status failed and its error)"."""
    proc = start_fault_server(tiny_llama, "crash@6")
    try:
        body = {"input": "Hello", "max_output_tokens": 100, "stream": True, "ignore_eos": True}
        r = httpx.post(proc.url + "/v1/responses", json=body, timeout=120)
        names = [x.split("\n")[0].removeprefix("event: ") for x in r.text.split("\n\n") if x]
        assert "response.output_text.delta" in names
        assert names[-2:] == ["error", "response.failed"]
        failed = json.loads(r.text.strip().split("\n\n")[-1].split("data: ", 1)[1])
        assert failed["response"]["status"] == "failed"
        assert failed["response"]["error"]["code"] == "server_error"
    finally:
        proc.stop()


def test_a_request_whose_retry_fails_too_gets_500(tiny_llama):
    proc = start_fault_server(tiny_llama, "crash@1,crash@2")
    try:
        r = httpx.post(proc.url + CHAT, json=SEEDED, timeout=120)
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "server_error"
        wait_for(lambda: health(proc.url)["status"] == "ok", timeout=60, interval=0.1)
        assert health(proc.url)["worker_restarts"] == 2
    finally:
        proc.stop()


def test_a_hung_step_is_a_fault(tiny_llama, reference_text):
    proc = start_fault_server(tiny_llama, "hang@3", "--step-timeout", "2")
    try:
        t0 = time.monotonic()
        r = httpx.post(proc.url + CHAT, json=SEEDED, timeout=120)
        assert r.status_code == 200
        assert r.json()["choices"][0]["message"]["content"] == reference_text
        assert time.monotonic() - t0 >= 2.0
        assert health(proc.url)["worker_restarts"] == 1
    finally:
        proc.stop()


async def test_while_the_engine_restarts_health_says_loading_and_requests_get_503(tiny_llama):
    proc = start_fault_server(tiny_llama, "crash@1")
    url = proc.url
    try:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(http.post, CHAT, json=SEEDED))
                while (h := (await http.get("/health")).json())["status"] != "loading":
                    await trio.sleep(0.01)
                assert h["worker_restarts"] == 1
                r = await http.post(CHAT, json=chat_body(max_tokens=1))
                assert r.status_code == 503
                assert r.json()["error"]["type"] == "unavailable"
                assert int(r.headers["Retry-After"]) >= 1
                m = await http.post("/v1/messages", json=chat_body(max_tokens=1))
                assert m.status_code == 529
                assert m.json()["error"]["type"] == "overloaded_error"
                assert m.headers["x-should-retry"] == "true"
        assert health(url)["status"] == "ok"
    finally:
        proc.stop()


# --- shutdown ------------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_shutdown_ends_streams_with_an_error_and_exits_0(tiny_llama, signum):
    proc = start_fault_server(tiny_llama, "slow=0.02")
    sock = rawhttp.connect(proc.url)
    rawhttp.post_json(sock, CHAT, chat_body(max_tokens=200, ignore_eos=True, stream=True))
    rawhttp.read_until(sock, b'"content": "')
    t0 = time.monotonic()
    proc.proc.send_signal(signum)
    data, closed = rawhttp.read_to_eof(sock, timeout=10)
    assert closed
    assert b"shutting down" in data
    assert proc.wait_exit(10) == 0
    assert time.monotonic() - t0 < 5
    sock.close()
    proc.stop()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", int(proc.url.rsplit(":", 1)[1])), timeout=1)


def test_a_request_whose_engine_hangs_twice_is_a_504_backend_timeout(tiny_llama):
    """A hung engine is a timeout, not a crash: after its one retry hangs too, chat answers
    504 with code backend_timeout, the name seed 004 gives it."""
    proc = start_fault_server(tiny_llama, "hang@1,hang@2", "--step-timeout", "1")
    try:
        r = httpx.post(proc.url + CHAT, json=SEEDED, timeout=120)
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "backend_timeout"
    finally:
        proc.stop()
