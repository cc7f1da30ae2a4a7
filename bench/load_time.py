"""How long a model takes to load: `mashbox run` against llama-server on the same GGUF, taking
turns, each timed from its start to its first `/health` 200 (both answer 503 while loading),
and to the end of a first short answer asked for at that moment (what a script that waits
for health sees: work left for after ready shows there).

    python bench/load_time.py --llama-server /tmp/llama/build/bin/llama-server \
        [--model qwen2.5-coder-0.5b-instruct | --model /tmp/llama-8b.gguf] [--rounds 3]

Every round reads the file from the page cache (one read first, untimed), so the times are a
warm start's: what a nox matrix or a restart pays. The floor printed beside them is reading
the file once plus writing what the engine holds, at this machine's measured memory
bandwidth; llama-server maps the file and holds its bytes as they are, so its floor is lower.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PROMPT = "The three primary colours are"  # the first answer's, greedy


def time_to_ready(
    cmd: list[str], port: int, log: Path, timeout: float = 600
) -> tuple[float, float, dict]:
    """Seconds from starting `cmd` to its first /health 200, and to the end of an 8-token
    greedy completion asked for then; and its /v1/models card."""
    with open(log, "w") as out:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"
    try:
        while time.monotonic() - t0 < timeout:
            if proc.poll() is not None:
                raise SystemExit(f"{cmd[0]} exited; see {log}")
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    ready = time.monotonic() - t0
                    card = httpx.get(url + "/v1/models").json()["data"][0]
                    ask = {"model": card["id"], "prompt": PROMPT, "max_tokens": 8}
                    answer = httpx.post(url + "/v1/completions", json=ask | {"temperature": 0})
                    answer.raise_for_status()
                    return ready, time.monotonic() - t0, card
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise SystemExit(f"{cmd[0]} was not ready in {timeout} s; see {log}")
    finally:
        proc.terminate()
        proc.wait(30)


def copy_bandwidth() -> float:
    """Bytes a second this machine copies in memory (1 GiB, best of three)."""
    a = torch.empty(2**30, dtype=torch.uint8).fill_(1)
    b = torch.empty_like(a)
    best = min(_timed(lambda: b.copy_(a)) for _ in range(3))
    return 2 * a.numel() / best  # read and written


def _timed(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", type=Path, required=True)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="id or .gguf")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--slots", type=int, default=1)
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()

    from mashbox import registry

    path = Path(args.model)
    if path.suffix != ".gguf":
        path = registry.fetch(registry.resolve(args.model), registry.default_models_dir())
    file_bytes = path.stat().st_size
    path.read_bytes()  # into the page cache: every round starts warm
    logs = Path("/tmp")
    times: dict[str, list[float]] = {"llama-server": [], "mashbox": []}
    answered: dict[str, list[float]] = {"llama-server": [], "mashbox": []}
    held = 0.0
    for r in range(args.rounds):
        # Taking turns, each first in every other round: on this VM a process that maps and
        # writes gigabytes just after another freed them ran ~1.5x as long (stop 50).
        order = ["llama-server", "mashbox"] if r % 2 == 0 else ["mashbox", "llama-server"]
        for name in order:
            port = free_port()
            if name == "llama-server":
                cmd = [
                    str(args.llama_server), "-m", str(path), "-c", str(args.ctx * args.slots),
                    "-np", str(args.slots), "-t", str(args.threads), "--host", "127.0.0.1",
                    "--port", str(port),
                ]  # fmt: skip
            else:
                cmd = [
                    sys.executable, "-m", "mashbox.cli", "run", str(path), "--port", str(port),
                    "--slots", str(args.slots), "--ctx", str(args.ctx),
                    "--threads", str(args.threads),
                ]  # fmt: skip
            seconds, answer, card = time_to_ready(cmd, port, logs / f"load_time_{name}.log")
            times[name].append(seconds)
            answered[name].append(answer)
            if name == "mashbox":
                held = card["gb"]
        print(
            f"round {r + 1} ({order[0]} first): llama-server {times['llama-server'][-1]:.2f} s "
            f"(answered {answered['llama-server'][-1]:.2f} s), mashbox {times['mashbox'][-1]:.2f} "
            f"s (answered {answered['mashbox'][-1]:.2f} s)",
            flush=True,
        )
    bandwidth = copy_bandwidth()
    floor = (file_bytes + held * 1e9) / bandwidth
    print(f"\n{path.name}: {file_bytes / 1e9:.2f} GB file, mashbox holds {held:.2f} GB")
    for title, seconds in (("/health 200", times), ("a first 8-token answer's end", answered)):
        llama_s, mash_s = (statistics.median(seconds[k]) for k in ("llama-server", "mashbox"))
        print(f"start to {title}, median of {args.rounds}:")
        for name, median in (("llama-server", llama_s), ("mashbox", mash_s)):
            rounds = ", ".join(f"{t:.2f}" for t in seconds[name])
            print(f"  {name:12s} {median:.2f} s ({rounds})")
        print(f"  ratio (llama-server / mashbox): {llama_s / mash_s:.2f}x")
    print(
        f"memory copies {bandwidth / 1e9:.1f} GB/s here: reading the file and writing what "
        f"mashbox holds takes at least {floor:.2f} s"
    )


if __name__ == "__main__":
    main()
