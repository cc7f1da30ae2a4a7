"""The prompt cache on disk (`--cache-dir`): saved KV prefixes that outlive the engine process.

The engine writes and reads the files; the scheduler's index (`prompt_cache.PromptCache`)
decides what is written, restored and removed, and learns what a directory holds from the
engine's `EngineInfo.disk_entries` (the engine alone can check a file against its model).

One file per prefix, named by `prompt_cache.disk_name(key, tenant, tokens)`:

    magic (8) | version (u32) | header length (u32) | sha256 of the header (32) | header | KV

The header (JSON) holds the engine's key (model checksum, KV layout and what computes the
KV, the engine's own code included: see `disk_key`), the tenant, the token ids, the
payload's size and crc32. The payload is K then V, each [layers, kv_heads, tokens,
head_dim] in the cache's dtype. A file is written under a temporary name and renamed, so a
crash leaves a stray temporary file, never a torn entry under a real name. A file whose
header, size, name or crc32 does not match is removed, never loaded: the engine prefills
those tokens instead (`Engine` on a failed restore).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..prompt_cache import disk_name
from ..protocol import DiskEntry

log = logging.getLogger("mashbox.engine")

MAGIC = b"MBKVDISK"
VERSION = 1
_PREFIX = struct.Struct("<8sII32s")  # magic, version, header length, header sha256
SUFFIX = ".kv"
STALE_TMP_S = 600.0  # a temporary file this old belongs to no write still running
FALLBACK_CHUNK = 256  # a failed restore's tokens are prefilled this many at a time
MAX_PENDING_BYTES = 2 << 30  # saved prefixes queued for the writer thread, at most


def for_engine(root: Path, cap_bytes: int, model_sha: str, model_path: Path, engine, kernels):
    """The disk cache of an engine being built (its model and cache are loaded)."""
    from ..server.identity import weights_sha  # torch-free; what the server hashes too

    cfg = engine.cfg
    dtype_name = str(engine.cache.k.dtype).removeprefix("torch.")
    layout = {"dtype": dtype_name, "dims": [cfg.n_layers, cfg.n_kv_heads, cfg.head_dim]}
    compute = {
        "decode_weights": engine.model.decode_kind,
        "kernels": kernels,
        "device": engine.device.type,
        "torch": torch.__version__,
        "engine": engine_code(),
    }
    key = disk_key(model_sha or weights_sha(model_path, None), layout, compute)
    dims = (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
    return DiskCache(root, cap_bytes, key, engine.cache.k.dtype, dims)


@functools.cache
def engine_code() -> str:
    """A digest of the engine's own code (this package's sources): another version of mashbox
    may compute other bits for the same prompt (stop 44's prefill norms did), so the files it
    wrote are another engine's."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.iterdir()):
        if path.suffix in (".py", ".cpp", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def disk_key(model_sha: str, layout: dict, compute: dict) -> str:
    """What a file's KV is valid for: the model's checksum, the cache's layout (dtype and
    shape) and what computed it (decode weights, kernels, device, torch, the engine's code),
    so a restored prefix is bit for bit what this engine's own prefill writes."""
    value = {"model": model_sha, "layout": layout, "compute": compute}
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


class DiskCache:
    """KV prefix files in one directory, written in the background, checked when read."""

    def __init__(self, root: Path, cap_bytes: int, key: str, dtype: torch.dtype, dims: tuple):
        """dims: (layers, kv_heads, head_dim) of the engine's cache."""
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)  # it holds prompts' tokens
        self.cap_bytes, self.key, self.dtype, self.dims = cap_bytes, key, dtype, dims
        self.dtype_name = str(dtype).removeprefix("torch.")
        # One writer thread: writes never stall a step, and run in the order saved.
        # Pending writes finish when the process exits normally (executor threads are joined).
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-disk")
        self._pending, self._pending_lock = 0, threading.Lock()  # bytes queued for the writer

    def path(self, name: str) -> Path:
        return self.root / (name + SUFFIX)

    # --- start: what the directory holds -----------------------------------------------------

    def scan(self) -> tuple[DiskEntry, ...]:
        """The usable entries, least recently used first; every file that is not one of this
        engine's (torn, corrupted, another model's or layout's) is removed, then the least
        recently used until the directory is under its cap."""
        now = time.time()
        found = []
        for path in self.root.iterdir():
            if path.name.endswith(".tmp"):
                if now - _mtime(path) > STALE_TMP_S:  # a crashed write's leftover
                    _remove(path)
                continue
            if not path.name.endswith(SUFFIX):
                continue
            header, _ = self._read_header(path)
            if header is None:
                _remove(path)
                continue
            size = path.stat().st_size
            tokens = tuple(header["token_ids"])
            found.append((_mtime(path), size, DiskEntry(path.stem, header["tenant"], tokens)))
        found.sort(key=lambda item: item[0])
        total = sum(size for _, size, _ in found)
        while found and total > self.cap_bytes:
            _, size, entry = found.pop(0)
            _remove(self.path(entry.name))
            total -= size
        return tuple(entry for _, _, entry in found)

    def _read_header(self, path: Path) -> tuple[dict | None, int]:
        """The header and where the payload starts, if the file is one of this engine's,
        whole (by size) and named as its contents say; else None."""
        try:
            with open(path, "rb") as f:
                magic, version, length, digest = _PREFIX.unpack(f.read(_PREFIX.size))
                raw = f.read(length)
            if magic != MAGIC or version != VERSION or len(raw) != length:
                return None, 0
            if hashlib.sha256(raw).digest() != digest:
                return None, 0
            header = json.loads(raw)
            layers, heads, dim = self.dims
            n = len(header["token_ids"])
            expected = 2 * layers * heads * n * dim * self.dtype.itemsize
            if (
                header["key"] != self.key
                or header["dtype"] != self.dtype_name
                or header["shape"] != [layers, heads, n, dim]
                or header["payload_bytes"] != expected
                or path.stat().st_size != _PREFIX.size + length + expected
                or path.stem != disk_name(self.key, header["tenant"], header["token_ids"])
            ):
                return None, 0
            return header, _PREFIX.size + length
        except (OSError, ValueError, KeyError, TypeError, struct.error):
            return None, 0

    # --- writes ------------------------------------------------------------------------------

    def write(self, name: str, tenant: str, tokens: tuple, k: torch.Tensor, v: torch.Tensor):
        """Write a prefix's KV (host copies, [layers, kv_heads, n, head_dim]) in the
        background; not at all while the writer is MAX_PENDING_BYTES behind (a slow disk
        must not fill the worker's memory with copies waiting for it)."""
        size = 2 * k.numel() * k.element_size()
        with self._pending_lock:
            if self._pending + size > MAX_PENDING_BYTES:
                log.info("prompt cache: %s not written, the disk is behind", name)
                return None
            self._pending += size
        future = self._writer.submit(self._write, name, tenant, tokens, k, v)
        future.add_done_callback(lambda _: self._written(size))
        return future

    def _written(self, size: int) -> None:
        with self._pending_lock:
            self._pending -= size

    def _write(self, name, tenant, tokens, k, v) -> None:
        payload = [_bytes(k), _bytes(v)]
        crc = zlib.crc32(payload[1], zlib.crc32(payload[0]))
        header = json.dumps(
            {
                "key": self.key,
                "tenant": tenant,
                "dtype": self.dtype_name,
                "shape": list(k.shape),
                "payload_bytes": len(payload[0]) + len(payload[1]),
                "payload_crc32": crc,
                "token_ids": list(tokens),
            }
        ).encode()
        prefix = _PREFIX.pack(MAGIC, VERSION, len(header), hashlib.sha256(header).digest())
        tmp = self.root / f"{name}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                for part in (prefix, header, *payload):
                    f.write(part)
                f.flush()
                os.fsync(f.fileno())  # the rename must not outlive the data in a crash
            os.replace(tmp, self.path(name))
        except OSError as exc:
            log.warning("cannot write prompt cache file %s: %s", self.path(name), exc)
            _remove(tmp)

    def flush(self) -> None:
        """Wait until every write queued so far is on disk."""
        self._writer.submit(lambda: None).result()

    def remove(self, name: str) -> None:
        """Forget an entry (the index evicted it); after the writes queued before it."""
        self._writer.submit(_remove, self.path(name))

    # --- reads -------------------------------------------------------------------------------

    def read(self, name: str, tokens: tuple) -> tuple | None:
        """The entry's K and V if its file is whole and holds these tokens' KV (at its start)
        for this engine; else None, and the file is removed. The name binds the tenant."""
        self.flush()  # a restore right after its own write reads the finished file
        path = self.path(name)
        header, start = self._read_header(path)
        held = tuple(header["token_ids"][: len(tokens)]) if header else ()
        if header is None or held != tuple(tokens):
            _remove(path)
            return None
        data = torch.empty(header["payload_bytes"], dtype=torch.uint8)  # not zeroed first
        try:
            with open(path, "rb") as f:
                f.seek(start)
                if f.readinto(data.numpy()) != len(data):
                    raise OSError("short read")
        except OSError:
            _remove(path)
            return None
        if zlib.crc32(data.numpy()) != header["payload_crc32"]:
            log.warning("prompt cache file %s is corrupted: removed", path)
            _remove(path)
            return None
        os.utime(path)  # least recently used goes first, at the next start's scan too
        k, v = data.view(self.dtype).view(2, *header["shape"])
        return k, v


def _bytes(t: torch.Tensor) -> memoryview:
    """A contiguous host tensor's bytes, without a copy."""
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot remove prompt cache file %s: %s", path, exc)
