"""Build mashbox's CPU kernels down a ladder of compiler targets, remembering every outcome.

A compiler can crash on one machine's `-march=native` (Debian 12's g++ 12.2 on AMD Zen 4:
an internal compiler error in `q8_gemm`) and build the same sources for a slightly smaller
target. So the targets are tried in order, fastest first; the caller keeps the first that
compiles and passes its self-check. Each outcome, failures included, is recorded under a key
of the sources, compiler, flags, torch and (for native targets) the CPU, so no process
repeats a compile that failed, and a build stopped halfway leaves nothing that blocks the
next one.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import attrs
import torch

COMPILED = [
    Path(__file__).with_name(name)
    for name in (
        "int8_gemm.cpp",
        "blocks_gemm.cpp",
        "rounded_gemm.cpp",
        "prefill_attention.cpp",
        "decode_layers.cpp",
        "block_repack.cpp",
    )
]
# What a build's record stands for: the code, and the packers and self-check that judged it.
SOURCES = [
    *COMPILED,
    *(
        Path(__file__).with_name(n)
        for n in ("cpu_kernels.h", "chunk_pool.h", "decode_math.h", "cpu_kernels.py")
    ),
]

# What the kernels themselves need to run (/proc/cpuinfo names); the x86-64 levels' own sets.
KERNEL_NEEDS = frozenset({"avx2", "fma", "f16c"})
X86_64_V3 = KERNEL_NEEDS | {"bmi1", "bmi2", "movbe", "abm"}
X86_64_V4 = X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@attrs.frozen
class Target:
    name: str
    flags: tuple[str, ...]
    needs: frozenset[str]  # CPU flags the built code may use
    # (CPU flag, compiler flag): extensions the kernels gain from, added where the CPU has
    # them (VNNI's integer dot products: ~1.3x at 8 rows here).
    extras: tuple[tuple[str, str], ...] = ()

    @property
    def native(self) -> bool:
        return "-march=native" in self.flags


V4_EXTRAS = (("avx512_vnni", "-mavx512vnni"),)
V3_EXTRAS = (("avx_vnni", "-mavxvnni"),)
# Fastest first. The second is native without what is known to crash compilers (the kernels
# use no BF16 instruction); on a CPU without AVX-512 BF16 it is native itself, so its `needs`
# skip it there. The portable levels take back what the kernels use of the CPU's own.
LADDER = (
    Target("native", ("-march=native",), KERNEL_NEEDS),
    Target("native-no-bf16", ("-march=native", "-mno-avx512bf16"), KERNEL_NEEDS | {"avx512_bf16"}),
    Target("x86-64-v4", ("-march=x86-64-v4",), X86_64_V4, V4_EXTRAS),
    Target("x86-64-v3", ("-march=x86-64-v3", "-mf16c", "-mfma"), X86_64_V3, V3_EXTRAS),
)
# MASHBOX_CPU_KERNELS=avx2: the 256-bit kernels on any machine (to test or time both widths).
LADDER_256 = (
    Target("native-avx2", ("-march=native", "-mno-avx512f"), KERNEL_NEEDS),
    LADDER[-1],
)
TARGETS = {t.name: t for t in LADDER + LADDER_256}

# MASHBOX_KERNELS_BREAK=native,...: those targets fail to compile on purpose (an #error in
# cpu_kernels.h, fatal at once), so tests can drive the ladder through a real compiler.
BREAK_FLAGS = ("-DMASHBOX_BREAK_BUILD", "-Wfatal-errors")


def ladder() -> tuple[Target, ...]:
    """The targets MASHBOX_CPU_KERNELS asks for: unset or "1" the whole ladder, "avx2" the
    256-bit one, a target's name that target alone. ValueError for anything else."""
    choice = os.environ.get("MASHBOX_CPU_KERNELS", "")
    if choice in ("", "1"):
        return LADDER
    if choice == "avx2":
        return LADDER_256
    if choice in TARGETS:
        return (TARGETS[choice],)
    names = ", ".join(["0", "avx2", *TARGETS])
    raise ValueError(f"MASHBOX_CPU_KERNELS={choice!r} is none of {names}")


def flags_for(target: Target) -> tuple[str, ...]:
    """The target's flags on this CPU: its extras where the CPU has them."""
    extras = tuple(flag for cpu_flag, flag in target.extras if cpu_flag in cpu()[1])
    broken = os.environ.get("MASHBOX_KERNELS_BREAK", "").split(",")
    return target.flags + extras + (BREAK_FLAGS if target.name in broken else ())


@functools.cache
def cpu() -> tuple[str, frozenset[str]]:
    """The CPU's model name and flags, from /proc/cpuinfo (torch's view where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    model = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
    flags = re.search(r"^flags\s*:\s*(.*)$", text, re.M)
    if flags:
        return (model.group(1) if model else "unknown"), frozenset(flags.group(1).split())
    capability = torch.backends.cpu.get_cpu_capability()
    known = {"AVX2": X86_64_V3, "AVX512": X86_64_V4}.get(capability, frozenset())
    return capability, known


def compiler() -> str:
    """The compiler torch's builder runs (CXX, else c++), as its --version's first line."""
    return _compiler_version(os.environ.get("CXX", "c++"))


@functools.cache
def _compiler_version(cxx: str) -> str:
    if shutil.which(cxx) is None:
        return ""
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
    return out.stdout.splitlines()[0] if out.returncode == 0 and out.stdout else ""


def machine_lacks() -> str | None:
    """Why this machine cannot build the kernels at all (remedy included), or None."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the CPU is {platform.machine()}, not x86-64 (the kernels are AVX2 code)"
    missing = KERNEL_NEEDS - cpu()[1]
    if missing:
        return f"the CPU lacks {', '.join(sorted(missing))} (the kernels need AVX2, FMA, F16C)"
    if not compiler():
        cxx = os.environ.get("CXX", "c++")
        return f"no C++ compiler ({cxx}): install g++ (apt-get install g++)"
    if not _ninja_runs():
        return "no ninja (torch's extension builder needs it): pip install ninja"
    return None


def _ninja_runs() -> bool:
    """torch's builder's own test (`ninja --version` runs), without importing its module:
    that imports setuptools, ~60 ms of every start that finds its build cached."""
    try:
        subprocess.run(["ninja", "--version"], capture_output=True, check=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return True


@attrs.frozen
class Record:
    """What became of one target's build: ok with the module's file, or the reason it failed."""

    target: str
    flags: tuple[str, ...]
    ok: bool
    reason: str = ""  # why not ok: the compiler's first error, or the self-check's
    seconds: float = 0.0  # the compile's wall time
    library: str = ""  # the built module's file, when ok


def root() -> Path:
    env = os.environ.get("MASHBOX_KERNELS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "mashbox" / "kernels"


def directory(target: Target, flags: tuple[str, ...]) -> Path:
    """Where this target's build and record live: named by everything that changes the code."""
    model, cpu_flags = cpu()
    key = {
        "sources": [hashlib.sha256(s.read_bytes()).hexdigest() for s in SOURCES],
        "compiler": compiler(),
        "flags": flags,
        "torch": torch.__version__,
        "python": sys.version_info[:2],
        "cpu": [model, sorted(cpu_flags)] if target.native else None,
    }
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:12]
    return root() / f"{target.name}-{digest}"


def recorded(where: Path) -> Record | None:
    try:
        data = json.loads((where / "record.json").read_text())
        return Record(**{**data, "flags": tuple(data["flags"])})
    except (OSError, ValueError, TypeError, KeyError):
        return None  # none yet, or torn: build again


def remember(where: Path, record: Record) -> None:
    """Write the record atomically: a process stopped halfway leaves none, never half of one."""
    tmp = where / f"record.json.{os.getpid()}"
    tmp.write_text(json.dumps(attrs.asdict(record)))
    tmp.replace(where / "record.json")


def forget(where: Path) -> None:
    (where / "record.json").unlink(missing_ok=True)


@contextlib.contextmanager
def exclusive(where: Path):
    """One builder per target at a time. flock is released by the kernel when its holder dies,
    so unlike torch's own baton file it can never be left behind by a stopped build."""
    where.mkdir(parents=True, exist_ok=True)
    with open(where / "build.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def module_name(where: Path) -> str:
    return "mashbox_cpu_kernels_" + where.name.replace("-", "_")


def compile_module(flags: tuple[str, ...], where: Path):
    """Compile with torch's extension builder and import the module, or raise with the
    compiler's message. Holding `exclusive(where)`: a baton file torch left there is stale."""
    from torch.utils.cpp_extension import load as build

    baton = where / "lock"
    if baton.exists():  # its owner was stopped mid-build; anyone alive would hold our flock
        baton.unlink()
    return build(
        module_name(where),
        sources=[str(s) for s in COMPILED],
        # OpenMP binds to the libgomp torch has loaded: one thread pool for both. C++20
        # (std::numbers, atomic waits), which torch's builder asks for only from torch 2.12:
        # the last -std wins.
        extra_cflags=["-O3", "-std=c++20", *flags, "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(where),
    )


def import_library(where: Path, library: str):
    """A module built earlier, imported from its file: no compiler, no ninja run."""
    name = module_name(where)
    if name in sys.modules:
        return sys.modules[name]
    loader = importlib.machinery.ExtensionFileLoader(name, library)
    spec = importlib.util.spec_from_file_location(name, library, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[name] = module
    return module


def first_error(exc: BaseException) -> str:
    """The line of a build failure worth showing: the compiler's first error (an internal
    compiler error included), else the message's last line."""
    text = str(exc)
    for line in text.splitlines():
        if re.search(r"\berror:", line) and not line.startswith(("FAILED", "[")):
            return re.sub(r"^\S*/", "", line.strip())[:300]  # from the file's own name
    return text.strip().splitlines()[-1][:300] if text.strip() else type(exc).__name__
