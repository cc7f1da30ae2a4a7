"""The kernel build ladder, through real compiles and real processes: a target that cannot
build is passed over for the next, its failure is remembered so no later process compiles it
again, a build stopped halfway blocks nothing, and a machine left with no kernels says so
loudly (log, /health, /v1/models, /metrics)."""

from __future__ import annotations

import os
import shutil
from unittest import mock

import httpx
import pytest
import torch

from mashbox.engine import cpu_kernels, kernel_build
from support.kernel_ladder import BROKEN, CHOSEN, kernels_cmd
from support.serverproc import serving

LACKS = kernel_build.machine_lacks()
needs_a_compiler = pytest.mark.skipif(LACKS is not None, reason=f"cannot build here: {LACKS}")


def usable_ladder() -> list[kernel_build.Target]:
    flags = kernel_build.cpu()[1]
    return [t for t in kernel_build.LADDER if t.needs <= flags]


@needs_a_compiler
def test_a_machine_without_ninja_is_told_to_install_it(tmp_path):
    """The compiler there, ninja not: `mashbox kernels` names the missing tool and its remedy
    rather than failing each target's build (exit 0, as on any machine that cannot build)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    cxx = os.environ.get("CXX", "c++")
    (bin_dir / cxx).symlink_to(shutil.which(cxx))
    out = kernels_cmd({"PATH": str(bin_dir), "MASHBOX_KERNELS_DIR": str(tmp_path / "k")})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "none: no ninja (torch's extension builder needs it): pip install ninja" in out.stderr
    assert not (tmp_path / "k").exists() or not any((tmp_path / "k").iterdir())


@needs_a_compiler
def test_the_self_check_passes_the_real_kernels_and_catches_one_wrong_bit():
    kernel = cpu_kernels.load()
    assert kernel is not None, cpu_kernels.report().fallback
    assert cpu_kernels.self_check(kernel) is None

    class OneUlpOff:  # the real kernels, but q4a16's last output one float32 step away
        def __getattr__(self, name):
            return getattr(kernel, name)

        def q4a16_linear(self, x, qs, dm):
            y = kernel.q4a16_linear(x, qs, dm)
            y[-1, -1] = torch.nextafter(y[-1, -1], torch.tensor(float("inf")))
            return y

    assert "q4a16_linear is not exact" in cpu_kernels.self_check(OneUlpOff())


@needs_a_compiler
@pytest.mark.slow
def test_a_target_that_cannot_build_gives_way_to_the_next_and_is_never_compiled_again(
    fallback_build, tiny_llama
):
    """native-avx2 fails to compile (an #error injected through MASHBOX_KERNELS_BREAK, so the
    real compiler runs and fails); the next target, x86-64-v3, is built and used (on the
    256-bit ladder, so the session's width tests use that build: support/kernel_ladder.py). A
    second process, a real server, compiles nothing: the failure is remembered, the build
    reused."""
    env, out = fallback_build.env, fallback_build.first
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {line.split()[0]: line for line in out.stdout.splitlines() if line.startswith("  ")}
    assert rows[BROKEN.name].split()[1] == "failed"
    assert "a build broken on purpose" in rows[BROKEN.name]
    assert rows[CHOSEN.name].split()[1] == "built"
    named = ", ".join(f.removeprefix("-march=") for f in kernel_build.flags_for(CHOSEN))
    assert f"({named})" in out.stdout.splitlines()[-1]

    with serving(str(tiny_llama), env=env) as server:
        log = "\n".join(server.lines)
        assert "compiling" not in log, log
        assert f"({named}), " in next(line for line in server.lines if "ready in" in line)
        health = httpx.get(server.url + "/health").json()
        assert health["decode"].endswith(f"({named})") and health["kernels_fallback"] is None
        card = httpx.get(server.url + "/v1/models").json()["data"][0]
        assert card["decode_kernels"].endswith(f"({named})")
        assert health["batch_invariant"] is card["batch_invariant"] is True
    again = kernels_cmd(env)
    rows = {line.split()[0]: line for line in again.stdout.splitlines() if line.startswith("  ")}
    assert rows[BROKEN.name].split()[1:3] == ["failed", "before"]
    assert rows[CHOSEN.name].split()[1] == "cached"


@needs_a_compiler
def test_with_no_target_left_the_server_says_so_loudly(tmp_path, tiny_llama):
    """Every target broken: each compile fails fast, a stale torch build lock left by a
    stopped build does not block the first, and the server runs on torch's ops with a warning
    that names the reason and the remedy, /health and /v1/models saying it, and a metric."""
    ladder = usable_ladder()
    env = {
        "MASHBOX_KERNELS_DIR": str(tmp_path),
        "MASHBOX_KERNELS_BREAK": ",".join(t.name for t in ladder),
    }
    with mock.patch.dict(os.environ, env):
        first = kernel_build.directory(ladder[0], kernel_build.flags_for(ladder[0]))
    first.mkdir(parents=True)
    (first / "lock").write_text("")  # torch's baton, as a killed build leaves it

    with serving(str(tiny_llama), env=env, timeout=300) as server:
        log = "\n".join(server.lines)
        assert "WARNING: decode runs on torch's float ops" in log
        assert "install another g++ and point CXX at it" in log
        health = httpx.get(server.url + "/health").json()
        assert "a build broken on purpose" in health["kernels_fallback"]
        assert health["decode"] == "float"
        card = httpx.get(server.url + "/v1/models").json()["data"][0]
        assert card["decode_kernels"] is None and card["kernels_fallback"]
        assert health["batch_invariant"] is card["batch_invariant"] is False
        metrics = httpx.get(server.url + "/metrics").text
        assert 'mashbox:cpu_kernels_fallback{model_name="' in metrics
        assert any(
            line.startswith("mashbox:cpu_kernels_fallback") and line.endswith(" 1.0")
            for line in metrics.splitlines()
        )
    assert not (first / "lock").exists()
    out = kernels_cmd(env)  # nothing compiled again, and a failing exit status
    assert out.returncode == 1
    tried = [line for line in out.stdout.splitlines() if line[:2] == "  " and "skipped" not in line]
    assert tried and all("failed before" in line for line in tried)
