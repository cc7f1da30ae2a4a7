"""nox sessions: tests, lint, serve (fuzz and bench arrive with their issues)."""

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
    session.run("ruff", "check", "src", "tests", "bench", "noxfile.py")


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
