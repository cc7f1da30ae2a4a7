"""Shared fixtures: tiny models built on the spot, and real servers running them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from support import kernel_ladder  # noqa: E402
from support.serverproc import ServerProcess, serving  # noqa: E402
from support.tinymodels import build_tiny_llama, build_tiny_qwen2  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A 2-layer Llama GGUF (SentencePiece vocabulary, Q8_0 and F32 tensors)."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), quantize=True)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    """A 2-layer Qwen2 GGUF (byte-level BPE vocabulary, qkv bias, tied embeddings)."""
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def trained_model(tmp_path_factory) -> Path:
    """The tiny model trained to think and call get_weather (tests/trained.py), built once."""
    from support import trained

    return trained.build_trained_model(tmp_path_factory.mktemp("trained"))


@pytest.fixture(scope="module")
def trained_url(trained_model):
    """A real `mashbox run` on the trained model (2 slots of 1024 tokens), one per module."""
    proc = ServerProcess(str(trained_model), "--ctx", "1024", "--slots", "2", "--threads", "1")
    try:
        yield proc.wait_ready(120)
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def fallback_build(fallback_build_started) -> kernel_ladder.FallbackBuild:
    """`mashbox kernels` falling from a broken native-avx2 to x86-64-v3, compiled for real in
    a folder of its own, once a session (support/kernel_ladder.py)."""
    return fallback_build_started.result()


@pytest.fixture(scope="session", autouse=True)
def fallback_build_started(request, tmp_path_factory):
    """That build, begun when the session starts where any test will need it."""
    needs = {"fallback_build", "narrow_kernels"}
    if not any(needs & set(item.fixturenames) for item in request.session.items):
        yield None
        return
    pending = kernel_ladder.PendingBuild(tmp_path_factory.mktemp("fallback-build"))
    yield pending
    pending.stop()


@pytest.fixture(scope="session")
def narrow_kernels(request):
    """That build's 256-bit kernels in this process, beside the 512-bit ones it runs; skips
    where this process's kernels are 256-bit already (or absent), before building."""
    from mashbox.engine import cpu_kernels

    if not cpu_kernels.report().isa.startswith("avx512"):
        pytest.skip("the kernels here are 256-bit only")
    narrow = request.getfixturevalue("fallback_build").load()
    assert narrow.isa().startswith("avx2"), narrow.isa()
    return narrow


@pytest.fixture(scope="session")
def server(tiny_llama, tmp_path_factory):
    """A real `mashbox run` on the tiny Llama: 4 slots of 1024 tokens."""
    with serving(
        str(tiny_llama), "--ctx", "1024", "--slots", "4", "--threads", "1",
        log=tmp_path_factory.mktemp("logs") / "server.log",
    ) as proc:  # fmt: skip
        yield proc


@pytest.fixture(scope="session")
def default_server(tmp_path_factory):
    """A real `mashbox run` on the shipped default model (fetched on first use)."""
    with serving("smollm2-135m-instruct", "--ctx", "2048", "--slots", "4", timeout=900) as proc:
        yield proc
