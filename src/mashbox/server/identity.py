"""The ids /health reports: what cached prompt KV is valid for, the programs this server runs,
and what the model is made of; each a sha256 over canonical JSON of what it names."""

from __future__ import annotations

import hashlib
import json
from importlib import metadata
from pathlib import Path

import attrs

from ..protocol import EngineInfo
from ..text.chat_template import ChatTemplate
from ..text.tokenizer import Tokenizer


@attrs.frozen
class Identity:
    """The ids /health reports; each a sha256 (hex) over canonical JSON of what it names."""

    cache_namespace: str  # what cached prompt KV is valid for
    deployment_id: str  # the programs this server runs
    component_set_sha: str  # what the model is made of
    # What a seeded answer repeats under: the model's parts and what computes its steps
    # (decode weights, the CPU kernels' target, device, dtype, KV dtype, mashbox and torch). Not the
    # slots, the context or the load: an answer is the same alone or beside others.
    answers: str = ""

    def system_fingerprint(self, seed: int) -> str:
        """`seed-N-fp_X`: a request with seed N answers the same wherever both parts match
        (the seed alone for a server that does not know its deployment yet)."""
        return f"seed-{seed}-fp_{self.answers}" if self.answers else f"seed-{seed}"


def _sha(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def weights_sha(path: Path, entry: dict | None) -> str:
    """The registry's sha256 of the weights (checked when fetched); for a local file or folder,
    a sha256 over each file's name, size and mtime: hashing gigabytes at every start is slow."""
    if entry is not None:
        return entry["sha256"]
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return _sha([[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files])


def model_identity(
    model_id: str,
    weights: str,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    info: EngineInfo,
    slots: int,
) -> Identity:
    """Hash the model's parts, its cache policy and the engine it runs on into the ids."""
    components = _sha(
        {
            "weights": weights,
            "tokenizer": tokenizer.fingerprint(),
            "chat_template": hashlib.sha256(template.source.encode()).hexdigest(),
        }
    )
    # What a saved prompt's KV means: exact token prefixes at this context and KV dtype.
    # The host cache's size is not part of it (it changes what is kept, not what it means).
    policy = {"prefix_reuse": True, "ctx": info.ctx, "kv_dtype": info.kv_dtype or info.dtype}
    namespace = _sha({"model": model_id, "components": components, "cache": policy})
    deployment = _sha(
        {
            "mashbox": _version("mashbox"),
            "torch": _version("torch"),
            "device": info.device,
            "dtype": info.dtype,
            "kv_dtype": info.kv_dtype,
            "decode_weights": info.decode_weights,
            "arch": info.arch,
            "ctx": info.ctx,
            "slots": slots,
            "model": model_id,
            "components": components,
        }
    )
    answers = _sha(
        {
            "mashbox": _version("mashbox"),
            "torch": _version("torch"),
            "device": info.device,
            "dtype": info.dtype,
            "kv_dtype": info.kv_dtype,  # float16 keys and values move the logits a little
            "decode": info.decode,  # decode weights and the kernels' compiler target
            "components": components,
        }
    )
    return Identity(namespace, deployment, components, answers[:12])


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None
