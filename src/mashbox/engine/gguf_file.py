"""A lean GGUF reader for the engine: scalar metadata and tensor data, fast.

gguf's `GGUFReader` builds an object for every element of every metadata array; the
vocabulary and merges of a big tokenizer (Qwen2.5: 151,936 tokens) take it tens of seconds.
The engine needs none of those arrays, so this reader skips them (strings are skipped by
their lengths, numbers by their size) and maps the tensors straight from the file.
The tokenizer reads the arrays it needs with `read_metadata` (Qwen2.5's in 0.2 s).
"""

from __future__ import annotations

import struct
from collections.abc import Collection
from pathlib import Path

import attrs
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# GGUF value type -> struct format (scalars); 8 = string, 9 = array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}  # fmt: skip
_STRING, _ARRAY = 8, 9


@attrs.frozen
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (rows first), as the model uses it
    qtype: GGMLQuantizationType
    data: np.ndarray  # raw bytes/values, memory-mapped


_U64 = struct.Struct("<Q")


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return value[0]

    def string(self) -> str:
        n = self.take("Q")
        text = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def strings(self, count: int, keep: bool = True) -> list[str]:
        """`count` strings in a row (a vocabulary's 150k: one tight loop, not a call each),
        or skipped past where not `keep`."""
        buf, pos, out = self.buf, self.pos, []
        length = _U64.unpack_from
        for _ in range(count):
            (n,) = length(buf, pos)
            pos += 8
            if keep:
                out.append(str(buf[pos : pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos
        return out

    def skip_array(self) -> None:
        kind, count = self.take("I"), self.take("Q")
        if kind == _STRING:
            self.strings(count, keep=False)
        elif kind == _ARRAY:
            for _ in range(count):
                self.skip_array()
        else:
            self.pos += struct.calcsize("<" + _SCALARS[kind]) * count

    def array(self) -> list:
        """An array's values as a list (as gguf's `ReaderField.contents()` gives them)."""
        kind, count = self.take("I"), self.take("Q")
        if kind == _STRING:
            return self.strings(count)
        if kind == _ARRAY:
            return [self.array() for _ in range(count)]
        dtype = np.dtype("<" + _SCALARS[kind])
        values = np.frombuffer(self.buf, dtype, count, self.pos)
        self.pos += dtype.itemsize * count
        return values.tolist()


def _header(path: Path, arrays: Collection[str]) -> tuple[np.memmap, _Cursor, int, dict]:
    """The file mapped, a cursor after its metadata, its tensor count, and the metadata:
    scalars, strings, and the arrays whose keys are in `arrays` (the rest skipped)."""
    # Copy-on-write: tensors can alias the mapped bytes (weights.load_gguf's blocks), and a
    # write to them changes a private page, never the file nor a read-only page's fault.
    raw = np.memmap(path, dtype=np.uint8, mode="c")
    cur = _Cursor(memoryview(raw))
    if bytes(raw[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    cur.pos = 4
    version, n_tensors, n_kv = cur.take("I"), cur.take("Q"), cur.take("Q")
    if version < 2:
        raise ValueError(f"GGUF version {version} is not supported")
    fields: dict = {}
    for _ in range(n_kv):
        key, kind = cur.string(), cur.take("I")
        if kind == _STRING:
            fields[key] = cur.string()
        elif kind == _ARRAY and key in arrays:
            fields[key] = cur.array()
        elif kind == _ARRAY:
            cur.skip_array()
        else:
            fields[key] = cur.take(_SCALARS[kind])
    return raw, cur, n_tensors, fields


def read(path: Path) -> tuple[dict, list[TensorInfo]]:
    """Scalar and string metadata (arrays skipped), and every tensor, memory-mapped."""
    raw, cur, n_tensors, fields = _header(path, ())
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.take("Q") for _ in range(cur.take("I"))]
        infos.append(
            (name, tuple(reversed(dims)), GGMLQuantizationType(cur.take("I")), cur.take("Q"))
        )
    align = int(fields.get("general.alignment", 32))
    start = (cur.pos + align - 1) // align * align
    tensors = []
    for name, shape, qtype, offset in infos:
        block, size = GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape)) // block * size
        data = raw[start + offset : start + offset + nbytes]
        tensors.append(TensorInfo(name, shape, qtype, data))
    return fields, tensors


def read_metadata(path: Path, arrays: Collection[str] = ()) -> dict:
    """Scalar and string metadata, and the arrays whose keys are in `arrays` (the tokenizer's
    vocabulary, say) as lists; the rest of the arrays and the tensors are skipped."""
    return _header(path, arrays)[3]
