"""mashbox replicas behind SGLang's model gateway (`smg`, from PyPI): two replicas of the tiny
model behind `smg launch --policy cache_aware`, driven through it with the official `openai`
and `anthropic` SDKs, streams included. Also `top_k: -1`, which the gateway forwards.

The replicas hold an API key; the gateway is given it with `--api-key`, which is both the key
it sends to workers and the one it asks of its own clients (as `Authorization: Bearer` only:
the Anthropic SDK is given it as `auth_token`). Without it the gateway cannot register the
replicas at all (their /v1/models answers 401), see docs/scale-out.md.
"""

from __future__ import annotations

import contextlib
import importlib.util
import signal
import socket
import subprocess
import sys
import time

import anthropic
import httpx
import openai
import pytest

from mashbox.server.errors import ApiError
from mashbox.server.generation import sampling_params
from mashbox.server.validate import Body
from support.serverproc import ServerProcess, wait_for

MODEL = "tiny-llama.gguf"
KEY = "router-test-key"
ALIAS = "claude-sonnet-4-5"  # a client's own model name, mapped with --model-alias
AUTH = {"Authorization": f"Bearer {KEY}"}
GENERATION_ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"]

needs_smg = pytest.mark.skipif(
    importlib.util.find_spec("smg") is None,
    reason="smg (SGLang's model gateway) is not installed: pip install -e '.[test]'",
)


# --- top_k: -1, the "off" of vLLM and SGLang that the gateway forwards ---------------------


def test_top_k_minus_one_is_off_and_lower_is_refused():
    assert sampling_params(Body({"top_k": -1})).top_k == 0
    assert sampling_params(Body({"top_k": 0})).top_k == 0
    assert sampling_params(Body({"top_k": 5})).top_k == 5
    with pytest.raises(ApiError, match="top_k") as exc:
        sampling_params(Body({"top_k": -2}))
    assert exc.value.status == 400


def _route_body(route: str, **extra) -> dict:
    if route == "/v1/completions":
        return {"prompt": "Tell me about Paris.", "max_tokens": 4, **extra}
    if route == "/v1/responses":
        return {"input": "Tell me about Paris.", "max_output_tokens": 4, **extra}
    messages = [{"role": "user", "content": "Tell me about Paris."}]
    return {"messages": messages, "max_tokens": 4, **extra}


@pytest.mark.parametrize("route", GENERATION_ROUTES)
def test_top_k_minus_one_on_every_generation_route(server, route):
    url = server.url + route
    seeded = {"temperature": 1.0, "seed": 11}
    off = httpx.post(url, json=_route_body(route, top_k=0, **seeded), timeout=60)
    minus_one = httpx.post(url, json=_route_body(route, top_k=-1, **seeded), timeout=60)
    assert off.status_code == minus_one.status_code == 200, minus_one.text
    assert _text(route, minus_one.json()) == _text(route, off.json())  # the same sampling
    bad = httpx.post(url, json=_route_body(route, top_k=-2), timeout=60)
    assert bad.status_code == 400
    assert "top_k" in bad.text


def _text(route: str, answer: dict) -> str:
    if route == "/v1/chat/completions":
        return answer["choices"][0]["message"]["content"]
    if route == "/v1/completions":
        return answer["choices"][0]["text"]
    if route == "/v1/responses":
        return "".join(c["text"] for item in answer["output"] for c in item.get("content", []))
    return "".join(block["text"] for block in answer["content"])


# --- two replicas behind the gateway -----------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Gateway:
    """`smg launch` in front of the given workers, on free ports; stopped with SIGTERM."""

    def __init__(self, workers: list[str], *args: str, policy: str = "cache_aware"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable, "-m", "smg", "launch",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--worker-urls", *workers,
            "--policy", policy,
            "--api-key", KEY,
            "--log-level", "warn",
            "--shutdown-grace-period-secs", "2",
            *args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )

    def wait_ready(self, timeout: float = 30) -> None:
        """Until the gateway has registered a worker for the model."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("smg exited:\n" + self.proc.stdout.read().decode()[-4000:])
            with contextlib.suppress(httpx.TransportError):
                r = httpx.get(self.url + "/v1/models", headers=AUTH, timeout=5)
                if r.status_code == 200 and any(m["id"] == MODEL for m in r.json()["data"]):
                    return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("smg registered no worker in time:\n" + self.output())

    def output(self) -> str:
        return self.proc.stdout.read().decode(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def replicas(tiny_llama, tmp_path_factory):
    """Two keyed replicas, 20 ms engine steps (a stream lasts long enough to leave)."""
    where = tmp_path_factory.mktemp("replicas")
    keys = where / "keys.txt"
    keys.write_text(f"{KEY} router\n")
    procs = [
        ServerProcess(
            str(tiny_llama), "--ctx", "1024", "--slots", "2", "--threads", "1",
            "--api-key-file", str(keys), "--drain-timeout", "20",
            env={"MASHBOX_FAULTS": "slow=0.02"}, log=where / f"replica{i}.log",
        )
        for i in range(2)
    ]  # fmt: skip
    try:
        for proc in procs:
            proc.wait_ready(120)
        yield procs
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture(scope="module")
def gateway(replicas):
    if importlib.util.find_spec("smg") is None:
        pytest.skip("smg (SGLang's model gateway) is not installed: pip install -e '.[test]'")
    gw = Gateway([p.url for p in replicas], "--model-alias", f"{ALIAS}={MODEL}")
    gw.wait_ready()
    yield gw
    gw.stop()


def live_rows(replicas) -> list[int]:
    return [
        httpx.get(p.url + "/health", headers=AUTH, timeout=5).json()["live_rows"] for p in replicas
    ]


MESSAGES = [{"role": "user", "content": "Tell me about Paris."}]


@needs_smg
def test_openai_sdk_chat_whole_and_streamed_through_the_gateway(gateway):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0)
    whole = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0
    )
    assert whole.model == MODEL
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 6
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content  # greedy: the same text either way
    assert chunks[-1].usage.completion_tokens == 6


@needs_smg
def test_openai_sdk_responses_whole_and_streamed_through_the_gateway(gateway):
    """The gateway sends `top_k: -1` on this route: before it meant "off" here, a 400. Greedy,
    so the tiny model cannot sample its end token before max_output_tokens runs out."""
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0)
    ask = {"model": MODEL, "input": "Hello there.", "max_output_tokens": 6, "temperature": 0}
    whole = client.responses.create(**ask)
    assert whole.status == "incomplete"  # max_output_tokens ran out
    assert whole.usage.output_tokens == 6
    assert whole.output_text
    events = list(client.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created"
    assert kinds[-1] == "response.incomplete"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text


@needs_smg
def test_anthropic_sdk_messages_whole_and_streamed_through_the_gateway(gateway):
    client = anthropic.Anthropic(base_url=gateway.url, auth_token=KEY, max_retries=0)
    whole = client.messages.create(
        model=MODEL, max_tokens=6, messages=MESSAGES, extra_body={"temperature": 0}
    )
    assert whole.stop_reason == "max_tokens"
    assert whole.usage.output_tokens == 6
    with client.messages.stream(
        model=MODEL, max_tokens=6, messages=MESSAGES, extra_body={"temperature": 0}
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text
    assert final.stop_reason == "max_tokens"


@needs_smg
def test_cache_aware_sends_a_repeated_prefix_back_to_the_replica_that_holds_it(gateway):
    client = anthropic.Anthropic(base_url=gateway.url, auth_token=KEY, max_retries=0)
    system = "You are a careful assistant for the router test. " * 20
    usages = [
        client.messages.create(
            model=MODEL,
            max_tokens=2,
            system=system,
            messages=[{"role": "user", "content": f"Question {i}."}],
        ).usage
        for i in range(3)
    ]
    for usage in usages[1:]:
        prompt = usage.input_tokens + usage.cache_read_input_tokens
        assert usage.cache_read_input_tokens > prompt // 2, usages


@needs_smg
def test_a_client_that_leaves_mid_stream_frees_its_slot_on_the_replica(gateway, replicas):
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 900,
        "ignore_eos": True,  # ~18 s of 20 ms steps: only leaving ends it early
        "stream": True,
    }
    with httpx.Client(timeout=30) as http:
        with http.stream(
            "POST", gateway.url + "/v1/chat/completions", json=body, headers=AUTH
        ) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(12):  # a few tokens in
                next(lines)
            assert sum(live_rows(replicas)) == 1
            t0 = time.monotonic()
    wait_for(lambda: sum(live_rows(replicas)) == 0, timeout=5)
    assert time.monotonic() - t0 < 5


@needs_smg
def test_keys_and_model_names_at_the_gateway(gateway, replicas):
    body = {"messages": MESSAGES, "max_tokens": 2}
    # The gateway asks its clients for the key it sends to the replicas.
    assert (
        httpx.post(gateway.url + "/v1/chat/completions", json={"model": MODEL, **body}).status_code
        == 401
    )
    # The replicas ask for it too: nothing reaches them around the gateway without it.
    assert httpx.post(replicas[0].url + "/v1/chat/completions", json=body).status_code == 401
    # Another model's name is the gateway's own 404, though mashbox would answer it on the
    # Anthropic and Responses routes; --model-alias NAME=MODEL maps a name the client uses.
    other = httpx.post(
        gateway.url + "/v1/messages", json={"model": "another-model", **body}, headers=AUTH
    )
    assert other.status_code == 404
    assert "another-model" in other.text
    for route in ("/v1/messages", "/v1/chat/completions"):
        aliased = httpx.post(
            gateway.url + route, json={"model": ALIAS, **body}, headers=AUTH, timeout=30
        )
        assert aliased.status_code == 200, aliased.text
        assert aliased.json()["model"] == MODEL


@needs_smg
def test_a_draining_replica_finishes_its_stream_while_new_requests_go_to_the_other(
    gateway, replicas
):
    """Last here: it stops one replica. SIGTERM with --drain-timeout: the stream it holds ends
    whole; requests sent meanwhile are answered by the other replica (the gateway retries the
    draining one's 503 elsewhere); the replica exits 0 once its stream is done."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 100, "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        with http.stream(
            "POST",
            gateway.url + "/v1/chat/completions",
            json={**body, "stream": True},
            headers=AUTH,
        ) as r:
            lines = r.iter_lines()
            next(lines)
            busy = live_rows(replicas)
            draining = replicas[busy.index(1)]
            draining.proc.send_signal(signal.SIGTERM)
            wait_for(
                lambda: httpx.get(draining.url + "/health", timeout=5).status_code == 503,
                timeout=2,
            )
            # The same prompt: cache_aware picks the draining replica first, every route.
            for route in ["/v1/chat/completions", "/v1/messages", "/v1/responses"] * 2:
                short = http.post(
                    gateway.url + route, json={**_route_body(route), "model": MODEL}, headers=AUTH
                )
                assert short.status_code == 200, (route, short.text)
            rest = list(lines)
    assert "data: [DONE]" in rest
    assert not any("error" in line for line in rest)
    assert draining.wait_exit(20) == 0
