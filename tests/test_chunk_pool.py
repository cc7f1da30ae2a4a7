"""The kernels' two ways of sharing work among threads (cpu_kernels.h): a decode step's small
calls on ChunkPool's helpers, a prefill chunk's big ones on torch's OpenMP threads. Which
thread computes a tile never changes its bits."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
from pathlib import Path

import pytest
import torch

from mashbox.engine import cpu_kernels, kernel_build

LACKS = kernel_build.machine_lacks()
pytestmark = pytest.mark.skipif(LACKS is not None, reason=f"cannot build the kernels: {LACKS}")
kernel = cpu_kernels.load()

# Up to cpu_kernels.h's POOLED_ROWS a matmul is a decode step's and goes to the pool.
ROWS = [1, 2, 8, 32, 33, 256]


def problem(rows: int):
    g = torch.Generator().manual_seed(rows)
    q = torch.randint(-127, 128, (960, 576), dtype=torch.int8, generator=g)
    x, scale = torch.randn(rows, 576, generator=g), torch.rand(960, generator=g) / 100
    return x, cpu_kernels.pack_int8(q), scale


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("count", [2, 3, 8])
def test_one_thread_and_several_give_the_same_bits(rows, count, threads):
    """More threads than cores too: helpers then lose their cores with their shares of a call
    untaken, and the others take those from the back."""
    x, packed, scale = problem(rows)
    threads(count)
    shared = [kernel.int8_linear(x, packed, scale) for _ in range(20)]
    threads(1)
    alone = kernel.int8_linear(x, packed, scale)
    assert all(torch.equal(y, alone) for y in shared)


def test_a_call_of_more_chunks_than_a_share_counts(threads):
    """A share holds 16-bit indices: 2^16 tiles and more are claimed in bigger chunks."""
    g = torch.Generator().manual_seed(7)
    q = torch.randint(-127, 128, (65537 * 32, 32), dtype=torch.int8, generator=g)
    x, scale = torch.randn(2, 32, generator=g), torch.rand(q.shape[0], generator=g) / 100
    packed = cpu_kernels.pack_int8(q)
    threads(2)
    shared = kernel.int8_linear(x, packed, scale)
    threads(1)
    assert torch.equal(shared, kernel.int8_linear(x, packed, scale))  # alone: every tile


def _in_child(conn, x, packed, scale) -> None:
    # Only the kernel here: torch's own OpenMP ops do not survive a fork (libgomp's threads
    # are not copied either, and it waits for them).
    conn.send(kernel.int8_linear(x, packed, scale).numpy().tobytes())  # not shared memory


def test_a_forked_process_starts_its_own_helpers(threads):
    """The parent's helper threads are not copied by fork: the child's calls must neither
    hang waiting for them nor skip their share of the work."""
    threads(2)
    x, packed, scale = problem(8)
    here = kernel.int8_linear(x, packed, scale)  # the parent's helpers are running now
    fork = multiprocessing.get_context("fork")
    parent, child = fork.Pipe()
    process = fork.Process(target=_in_child, args=(child, x, packed, scale))
    process.start()
    try:
        assert parent.poll(60), "the forked child did not answer within 60 s"
        assert parent.recv() == here.numpy().tobytes()
    finally:
        process.join(10)
        process.kill()


@pytest.mark.parametrize("standard", ["c++17", "c++20"])
def test_helpers_asleep_wake_for_the_next_job(standard, tmp_path):
    """torch's extension builder asks for C++17 before torch 2.12, which has no
    std::atomic::wait: there the helpers sleep on a futex of their own. Either way a job
    after they fell asleep wakes them (a pool that did not would still finish it, alone)."""
    engine = Path(kernel_build.__file__).parent
    program = tmp_path / "wake"
    cxx = os.environ.get("CXX", "c++")
    source = Path(__file__).parent / "support" / "chunk_pool_wake.cpp"
    build = [cxx, f"-std={standard}", "-O2", "-pthread", f"-I{engine}", str(source), "-o"]
    subprocess.run([*build, str(program)], check=True, capture_output=True, timeout=120)
    out = subprocess.run([str(program)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout
    assert out.stdout.startswith("ok: futex" if standard == "c++17" else "ok: std::atomic")
