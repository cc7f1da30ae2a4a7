"""nox sessions: lint, tests (per Python), e2e (the end-to-end matrix), fuzz, serve, bench, router.

`nox` runs the lean default that fits CI: lint, the whole suite on 3.11 and two e2e cells.
`nox -l` lists every session and matrix cell; `nox -s NAME` runs one (quote it), `nox -k
"qwen3 and int4"` every cell that matches, and `nox -R ...` skips the installs into virtualenvs
already made (they are always reused).

torch comes only from the CPU wheel on disk (PIP_FIND_LINKS=/opt/wheels), which is built for
Python 3.11: on any other Python pip would fetch PyPI's multi-GB CUDA build, so the sessions
there install mashbox without torch and run the tests that need none.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import tomllib
from pathlib import Path

import nox
from packaging.requirements import Requirement

nox.options.reuse_existing_virtualenvs = True

TORCH_PYTHON = "3.11"
PYTHONS = [TORCH_PYTHON, "3.12", "3.13"]
CPU_TORCH = "torch==2.13.0+cpu"  # the local label matches the wheel on disk, never PyPI's

# Test files that need neither torch nor tests/conftest.py (which builds tiny models with
# torch): the whole of the 3.12 and 3.13 runs. A file added here that needs either fails.
TORCH_FREE_TESTS = [
    "tests/test_bare_calls.py",
    "tests/test_chat_template.py",
    "tests/test_codecs.py",
    "tests/test_connections.py",
    "tests/test_encoding.py",
    "tests/test_line_limits.py",
    "tests/test_parser.py",
    "tests/test_registry.py",
    "tests/test_stops.py",
    "tests/test_tokenizer.py",
]

# The end-to-end matrix: every architecture the engine loads, both tokenizer kinds, the host
# prompt cache on and off, every --decode-weights kind (tests/test_matrix.py runs one cell).
FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
TOKENIZERS = ["sentencepiece", "bpe"]
PREFIX_CACHE = ["on", "off"]
DECODE_WEIGHTS = ["float", "int8", "int4", "int4a16", "int4a8"]
E2E_ENV = "e2e_env"


def _find_pyenv_pythons() -> None:
    """Let nox find pyenv's builds of PYTHONS: pyenv's shims answer only for the versions
    chosen (PYENV_VERSION, .python-version, `pyenv global`), so choose them all here unless
    the caller chose for themselves."""
    root = os.environ.get("PYENV_ROOT")
    if not root or "PYENV_VERSION" in os.environ or not Path(root, "versions").is_dir():
        return
    installed = [p.name for p in Path(root, "versions").iterdir()]
    chosen = []
    for minor in PYTHONS:
        builds = [v for v in installed if re.fullmatch(rf"{re.escape(minor)}\.\d+", v)]
        if builds:
            chosen.append(max(builds, key=lambda v: int(v.rsplit(".", 1)[1])))
    if chosen:
        os.environ["PYENV_VERSION"] = ":".join(chosen)


_find_pyenv_pythons()


def e2e_cell(family: str, tokenizer: str, prefix_cache: str, decode_weights: str) -> str:
    """A matrix cell's session name, as `nox -l` lists it."""
    return (
        f"e2e(family={family!r}, tokenizer={tokenizer!r}, prefix_cache={prefix_cache!r}, "
        f"decode_weights={decode_weights!r})"
    )


# Two cells besides the one a plain `pytest` runs (llama, sentencepiece, on, float): the
# other families' extra weights (qkv bias, q/k norms, tied head), the other tokenizer, the
# cache off, the default CPU decode kind and int8.
nox.options.sessions = [
    "lint",
    f"tests-{TORCH_PYTHON}",
    e2e_cell("qwen2", "bpe", "off", "int4a16"),
    e2e_cell("qwen3", "sentencepiece", "on", "int8"),
]


def _install(session: nox.Session) -> None:
    session.install(CPU_TORCH)
    session.install("-e", ".[test]")


def _install_without_torch(session: nox.Session) -> None:
    """mashbox and its test dependencies, less torch; wheels only, so a dependency without
    one for this Python skips the session (naming it) instead of building from source."""
    project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    deps = [d for d in wanted if Requirement(d).name != "torch"]
    no_torch = Path(session.create_tmp()) / "no-torch.txt"
    no_torch.write_text("torch<0\n")  # anything that pulls torch in fails to resolve
    pip = ["python", "-m", "pip", "install", "--only-binary=:all:", "-c", str(no_torch)]
    out = session.run_install(*pip, "--dry-run", *deps, silent=True, success_codes=[0, 1])
    missing = re.search(r"No matching distribution found for (\S+)", out or "")
    if missing and not missing.group(1).startswith("torch"):
        session.skip(f"{missing.group(1)} has no wheel for Python {session.python}")
    session.run_install(*pip, *deps)
    session.install("--no-deps", "-e", ".")


@nox.session(python=PYTHONS)
def tests(session: nox.Session) -> None:
    """The test suite: all of it on 3.11, the torch-free part on 3.12 and 3.13.

    3.11 runs what `pytest` runs; 3.12 and 3.13 the files in TORCH_FREE_TESTS, with mashbox
    installed less torch and without tests/conftest.py (--noconftest)."""
    if session.python == TORCH_PYTHON:
        _install(session)
        session.run("pytest", *session.posargs)
        return
    _install_without_torch(session)
    session.run("pytest", "--noconftest", *TORCH_FREE_TESTS, *session.posargs)


@nox.session(python=TORCH_PYTHON, default=False)
def e2e_env(session: nox.Session) -> None:
    """The virtualenv every e2e cell runs in (one for all 80: torch is large)."""
    _install(session)


@nox.session(python=False, requires=[E2E_ENV])
@nox.parametrize(
    ("family", "tokenizer", "prefix_cache", "decode_weights"),
    list(itertools.product(FAMILIES, TOKENIZERS, PREFIX_CACHE, DECODE_WEIGHTS)),
)
def e2e(
    session: nox.Session, family: str, tokenizer: str, prefix_cache: str, decode_weights: str
) -> None:
    """One cell of the end-to-end matrix: tests/test_matrix.py on a real server."""
    # nox names a session's virtualenv after it, under the folder that holds its cache.
    python = session.cache_dir.parent / E2E_ENV / "bin" / "python"
    cell = {
        "MASHBOX_MATRIX_FAMILY": family,
        "MASHBOX_MATRIX_TOKENIZER": tokenizer,
        "MASHBOX_MATRIX_PREFIX_CACHE": prefix_cache,
        "MASHBOX_MATRIX_DECODE_WEIGHTS": decode_weights,
    }
    session.run(
        str(python), "-m", "pytest", "tests/test_matrix.py", *session.posargs,
        env=cell, external=True,
    )  # fmt: skip


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and format check."""
    session.install("ruff")
    session.run("ruff", "check", "src", "tests", "fuzz", "bench", "noxfile.py")
    session.run("ruff", "format", "--check", "src", "tests", "fuzz", "bench", "noxfile.py")


@nox.session(python=TORCH_PYTHON)
def fuzz(session: nox.Session) -> None:
    """The fuzzers in fuzz/ at full strength; `-- --url URL`: against a running server.

    The default test run does a short pass. Without --url the fuzzers start a server on a tiny
    model; a server already running must take the key `fuzz-key` and the host name
    fuzz.example (see fuzz/conftest.py)."""
    _install(session)
    parser = argparse.ArgumentParser(prog="nox -s fuzz --", allow_abbrev=False, add_help=False)
    parser.add_argument("--url", help="fuzz this running server (the rest goes to pytest)")
    ours, args = parser.parse_known_args(session.posargs)
    env = {"MASHBOX_FUZZ_EXAMPLES": os.environ.get("MASHBOX_FUZZ_EXAMPLES", "200")}
    if ours.url:
        env["MASHBOX_FUZZ_URL"] = ours.url
    session.run("pytest", "fuzz", *args, env=env)


@nox.session(python=TORCH_PYTHON)
def serve(session: nox.Session) -> None:
    """Serve the default model (or the one given after --) on 127.0.0.1:8000."""
    _install(session)
    session.run("mashbox", "run", *session.posargs)


@nox.session(python=TORCH_PYTHON)
def bench(session: nox.Session) -> None:
    """Decode tokens/s of the default model through the HTTP API at 1 and 4 streams."""
    _install(session)
    session.run("python", "bench/decode_http.py", *session.posargs)


@nox.session(python=TORCH_PYTHON, default=False)
def router(session: nox.Session) -> None:
    """N replicas and SGLang's model gateway (smg) in front of them on this machine, until
    Ctrl-C: `nox -s router -- [-n N] [-p POLICY] [MODEL] [-- MASHBOX-ARGS]` (bench/replicas.sh,
    docs/scale-out.md)."""
    _install(session)
    session.run("bash", "bench/replicas.sh", *session.posargs, external=True)
