"""Every way a model can arrive: a Qwen2 GGUF with a BPE vocabulary, and an HF folder."""

from __future__ import annotations

import httpx
import pytest

from support import tinytok
from support.serverproc import ServerProcess
from support.tinymodels import random_weights, write_hf_folder


def chat(url: str, **extra) -> dict:
    body = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6, **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture
def served(request):
    procs = []

    def start(model, *args):
        proc = ServerProcess(str(model), "--ctx", "128", "--slots", "2", *args)
        procs.append(proc)
        return proc.wait_ready(120)

    yield start
    for proc in procs:
        assert proc.stop() == 0


def test_qwen2_gguf(served, tiny_qwen2):
    url = served(tiny_qwen2)
    r = chat(url)
    assert r["model"] == "tiny-qwen2.gguf"
    assert r["usage"]["completion_tokens"] >= 1
    again = chat(url)
    assert again["choices"][0]["message"] == r["choices"][0]["message"]


def test_hf_folder(served, tmp_path):
    tok = tinytok.train_bpe(tmp_path)
    weights = random_weights(vocab=tok.get_vocab_size(), seed=5)
    folder = write_hf_folder(tmp_path / "tiny-hf", weights, tok)
    url = served(folder)
    r = chat(url)
    assert r["model"] == "tiny-hf"
    assert httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"] == 128
