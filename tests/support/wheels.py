"""Minimal wheels written on the spot, as the model registry fetches models from PyPI."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path


def make_wheel(wheel_dir: Path, package: str, version: str, files: dict[str, bytes]) -> Path:
    """Write a minimal pure-Python wheel holding files, as pip expects one."""
    dist = package.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    contents = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: mashbox-tests\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    contents = {k: v.encode() if isinstance(v, str) else v for k, v in contents.items()}
    record = []
    for name, data in contents.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}\n")
    record.append(f"{info}/RECORD,,\n")
    contents[f"{info}/RECORD"] = "".join(record).encode()
    wheel_dir.mkdir(parents=True, exist_ok=True)
    path = wheel_dir / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in contents.items():
            zf.writestr(name, data)
    return path
