"""Time to first token of a long prompt: a fresh server without --cache-dir against a server
restarted on a --cache-dir that holds the prompt; then what the disk cache's writes and reads
cost for a 20k-token prefix of the default model's KV.

    python bench/disk_cache.py                       # default model, ~4k-token prompt
    python bench/disk_cache.py --tokens 2000 --model PATH.gguf

The first server (no cache dir) answers once: a fresh prefill. The second, on an empty cache
dir, answers twice (the repeat writes the prefix to disk) and stops; the third, started on
that dir, answers once: its time to first token is the restored prefix's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support.serverproc import ServerProcess  # noqa: E402


def system_prompt(tokens: int) -> str:
    """~`tokens` tokens of an agent's rules (about 36 tokens a line for SmolLM2's vocabulary)."""
    lines = (
        f"{i}. When you change code in module {i}, keep functions small, name things plainly, "
        "test the change, and explain what you did in one short paragraph."
        for i in range(1, tokens // 36 + 1)
    )
    return "You are a careful coding agent working in a Python repository.\n\n" + "\n".join(lines)


def first_token(url: str, system: str) -> tuple[float, str, dict]:
    """Seconds to the first streamed token, the greedy text and the usage."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Begin."}]
    body = {"messages": messages, "max_tokens": 16, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    first, text, usage = None, [], {}
    with httpx.Client(base_url=url, timeout=900) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                usage = event.get("usage") or usage
                for choice in event["choices"]:
                    content = choice["delta"].get("content") or ""
                    if first is None and (content or choice["finish_reason"]):
                        first = time.perf_counter() - t0
                    text.append(content)
    return first, "".join(text), usage


def serve(model: str, *args: str) -> ServerProcess:
    t0 = time.perf_counter()
    proc = ServerProcess(model, "--slots", "2", "--ctx", "8192", *args)
    proc.wait_ready(900)
    proc.ready_s = time.perf_counter() - t0
    return proc


def server_runs(model: str, tokens: int) -> None:
    system = system_prompt(tokens)
    proc = serve(model)
    try:
        fresh, fresh_text, usage = first_token(proc.url, system)
        fresh_ready = proc.ready_s
    finally:
        proc.stop()
    with tempfile.TemporaryDirectory() as cache_dir:
        proc = serve(model, "--cache-dir", cache_dir)
        try:
            first_token(proc.url, system)
            first_token(proc.url, system)  # the repeat: written to disk
        finally:
            proc.stop()
        size = sum(p.stat().st_size for p in Path(cache_dir).iterdir())
        proc = serve(model, "--cache-dir", cache_dir)
        ready = proc.ready_s
        try:
            restored, restored_text, restored_usage = first_token(proc.url, system)
        finally:
            proc.stop()
    cached = restored_usage["prompt_tokens_details"]["cached_tokens"]
    print(f"prompt: {usage['prompt_tokens']} tokens; cache dir: {size / 2**20:.0f} MiB")
    print(f"fresh server, no --cache-dir:     first token in {fresh:.2f} s "
          f"(ready in {fresh_ready:.1f} s)")  # fmt: skip
    print(f"restarted server on --cache-dir:  first token in {restored:.2f} s "
          f"({cached} tokens cached; ready in {ready:.1f} s)")  # fmt: skip
    print(f"same greedy text: {restored_text == fresh_text}")


def io_costs(model: str, tokens: int) -> None:
    """Copy out, write (the background thread's work), read and check, copy in: each timed
    for a `tokens`-long prefix in the model's KV layout (random values)."""
    import torch

    from mashbox import registry
    from mashbox.engine import weights as weights_mod
    from mashbox.engine.disk_cache import DiskCache
    from mashbox.engine.kv_cache import KVCache
    from mashbox.prompt_cache import disk_name

    path = registry.fetch(registry.resolve(model), registry.default_models_dir())
    cfg = weights_mod.load(path).config
    cache = KVCache(cfg, 1, tokens, "cpu", torch.float32)
    cache.k.normal_(), cache.v.normal_()
    dims = (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
    with tempfile.TemporaryDirectory() as root:
        disk = DiskCache(Path(root), 2**40, "bench", torch.float32, dims)
        t0 = time.perf_counter()
        k, v = cache.copy_out(0, tokens)
        t1 = time.perf_counter()
        ids = tuple(range(tokens))
        name = disk_name("bench", "", ids)
        disk.write(name, "", ids, k, v).result()
        t2 = time.perf_counter()
        saved = disk.read(name, ids)
        t3 = time.perf_counter()
        cache.copy_in(0, saved, tokens)
        t4 = time.perf_counter()
    mib = 2 * k.numel() * k.element_size() / 2**20
    print(f"{tokens} tokens of {model}'s KV (float32): {mib:.0f} MiB")
    print(f"  copy out (in the step):        {t1 - t0:.3f} s")
    print(f"  write + fsync (background):    {t2 - t1:.3f} s")
    print(f"  read + crc32 (in the step):    {t3 - t2:.3f} s")
    print(f"  copy in (in the step):         {t4 - t3:.3f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=4000, help="the prompt's length, about")
    parser.add_argument("--io-tokens", type=int, default=20000)
    args = parser.parse_args()
    if args.tokens:
        server_runs(args.model, args.tokens)
    io_costs(args.model, args.io_tokens)


if __name__ == "__main__":
    main()
