"""The 256-bit kernels, built once a session the way a machine whose first target fails builds
them: `mashbox kernels` in a folder of its own, on the 256-bit ladder (native-avx2, then
x86-64-v3) with native-avx2 broken on purpose, so the ladder falls to x86-64-v3 and compiles
it for real. test_kernel_ladder checks that walk; the width tests (the same bits at 256 and
512 bits) use what it built, so a session compiles one target fewer (~80 s on 2 cores).
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


class PendingBuild:
    """That build, started in the background at the session's start: `nice`d, so it takes
    the CPU the tests leave idle (a server test waiting on a timeout) rather than theirs,
    and the first test that needs it waits for what is left (~80 s of compiling on 2 cores
    otherwise spent in that test's setup)."""

    def __init__(self, folder: Path):
        self.env = {
            "MASHBOX_KERNELS_DIR": str(folder / "kernels"),
            "MASHBOX_CPU_KERNELS": "avx2",
            "MASHBOX_KERNELS_BREAK": BROKEN.name,
        }
        # Files, not pipes: a compiler's output larger than a pipe holds would block it.
        self.out, self.err = folder / "stdout", folder / "stderr"
        self.args = ["nice", "-n", "19", sys.executable, "-m", "mashbox.cli", "kernels"]
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen(
                self.args, stdout=out, stderr=err, text=True, env={**os.environ, **self.env}
            )
        self.done: FallbackBuild | None = None

    def result(self) -> FallbackBuild:
        if self.done is None:
            code = self.proc.wait(timeout=900)
            first = subprocess.CompletedProcess(
                self.args, code, self.out.read_text(), self.err.read_text()
            )
            self.done = FallbackBuild(self.env, first)
        return self.done

    def stop(self) -> None:
        """End it if no test waited for it (they were deselected, or -x stopped the run)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
