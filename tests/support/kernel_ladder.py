"""The 256-bit kernels, built once a session the way a machine whose first target fails builds
them: `mashbox kernels` in a folder of its own, on the 256-bit ladder (native-avx2, then
x86-64-v3) with native-avx2 broken on purpose, so the ladder falls to x86-64-v3 and compiles
it for real. test_kernel_ladder checks that walk; the width tests (the same bits at 256 and
512 bits) use what it built, so a session compiles one target fewer (~2 minutes on 2 cores).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import attrs

from mashbox.engine import cpu_kernels, kernel_build

BROKEN, CHOSEN = kernel_build.LADDER_256


def kernels_cmd(env: dict) -> subprocess.CompletedProcess:
    """`mashbox kernels` in a process of its own, with env over this one's."""
    return subprocess.run(
        [sys.executable, "-m", "mashbox.cli", "kernels"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=900,
    )


@attrs.frozen
class FallbackBuild:
    env: dict[str, str]  # the folder, the ladder and the broken target: give it to later runs
    first: subprocess.CompletedProcess  # the first `mashbox kernels` in that folder

    def load(self):
        """The built module, imported into this process (its self-check runs again)."""
        with mock.patch.dict(os.environ, self.env):
            attempt, module = cpu_kernels._try(CHOSEN)
        assert module is not None, attempt
        return module


def build_by_falling_back(folder: Path) -> FallbackBuild:
    env = {
        "MASHBOX_KERNELS_DIR": str(folder),
        "MASHBOX_CPU_KERNELS": "avx2",
        "MASHBOX_KERNELS_BREAK": BROKEN.name,
    }
    return FallbackBuild(env, kernels_cmd(env))
