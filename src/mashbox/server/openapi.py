"""/openapi.json: the project's OpenAPI 3.1 description, with the running model filled in.

The document ships in the package (`mashbox/openapi.json`); `specs/openapi.json` in the
repository is the same file (a test keeps them identical), written with the default model id.
"""

from __future__ import annotations

import copy
import functools
import json
from importlib import metadata, resources


@functools.cache
def _shipped() -> dict:
    text = resources.files("mashbox").joinpath("openapi.json").read_text(encoding="utf-8")
    return json.loads(text)


def document(model_id: str) -> dict:
    """The description this server serves: its version, and `model_id` in the text and in
    every example request."""
    doc = copy.deepcopy(_shipped())
    info = doc["info"]
    try:
        info["version"] = metadata.version("mashbox")
    except metadata.PackageNotFoundError:
        pass
    info["description"] += f" This server runs the model `{model_id}`."
    for item in doc["paths"].values():
        for operation in item.values():
            media = operation.get("requestBody", {}).get("content", {}).get("application/json")
            if media and "model" in media.get("example", {}):
                media["example"]["model"] = model_id
            for parameter in operation.get("parameters", []):
                if parameter["name"] == "model" and parameter["in"] == "path":
                    parameter["example"] = model_id
    return doc
