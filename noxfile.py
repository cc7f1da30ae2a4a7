"""nox sessions: tests, lint, fuzz, serve, bench."""

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True

CPU_TORCH = "torch==2.13.0"


def _install(session):
    session.install(CPU_TORCH)
    session.install("-e", ".[test]")


@nox.session
def tests(session):
    """Run the test suite (tiny models and the real default model)."""
    _install(session)
    session.run("pytest", *session.posargs)


@nox.session
def lint(session):
    """ruff check and format check."""
    session.install("ruff")
    session.run("ruff", "check", "src", "tests", "fuzz", "bench", "noxfile.py")
    session.run("ruff", "format", "--check", "src", "tests", "fuzz", "bench", "noxfile.py")


@nox.session
def fuzz(session):
    """The fuzzers in fuzz/ at full strength (the default test run does a short pass)."""
    _install(session)
    examples = session.env.get("MASHBOX_FUZZ_EXAMPLES", "200")
    session.run("pytest", "fuzz", *session.posargs, env={"MASHBOX_FUZZ_EXAMPLES": examples})


@nox.session
def serve(session):
    """Serve the default model (or the one given after --) on 127.0.0.1:8000."""
    _install(session)
    session.run("mashbox", "run", *session.posargs)


@nox.session
def bench(session):
    """Decode tokens/s of the default model through the HTTP API at 1 and 4 streams."""
    _install(session)
    session.run("python", "bench/decode_http.py", *session.posargs)
