"""What `echo` with `logprobs` costs (lm-eval's loglikelihood requests): a fresh prompt's
answer (`max_tokens` 1) plain, echoed, and echoed with the prompt tokens' log-probs, side by
side on one server, and a stream's longest gap between events while the echoes run.

The floor for the log-probs: every prompt row also goes through the output head (vocabulary
x width multiply-adds a row, beside the layers' weights a row), so echo's prefill can at
best take (layers + head) / layers of a plain one's time, where the head runs at the
layers' FLOP/s; the log-softmax over the vocabulary a row comes on top.

    python bench/echo_cost.py                       # default model, ~2,000-token prompts
    python bench/echo_cost.py --model qwen2.5-coder-0.5b-instruct --tokens 4000
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import time
from pathlib import Path

import httpx
from stream_gaps import gaps_around

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

TEXT = "The keeper climbed the stairs at dusk and lit the lamp above the harbour. "


def prompt(tokens: int) -> str:
    """A fresh prompt of about `tokens` tokens (a nonce first: nothing is cached)."""
    return f"[{secrets.token_hex(8)}] " + TEXT * (tokens // 15)


def answer_s(url: str, tokens: int, **extra) -> tuple[float, int]:
    body = {"prompt": prompt(tokens), "max_tokens": 1, "temperature": 0} | extra
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()["usage"]["prompt_tokens"]


def stream_gaps(url: str, during) -> tuple[float, float]:
    """A stream's median gap between events before `during()` runs, and its longest during."""
    before, inside = gaps_around(url, during)
    return statistics.median(before), max(inside, default=float("nan"))


def floor(model: str) -> float:
    """(a prompt row's multiply-adds in the layers + the head's) / the layers', read off the
    GGUF (attention's, which grow with the position, left out)."""
    import gguf

    from mashbox import registry

    path = registry.fetch(registry.resolve(model), registry.default_models_dir())
    tensors = {t.name: int(t.n_elements) for t in gguf.GGUFReader(path).tensors}
    head = tensors.get("output.weight", tensors["token_embd.weight"])  # (tied: the embedding)
    layers = sum(n for name, n in tensors.items() if name.startswith("blk."))
    return (layers + head) / layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="an already running server")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.url:
        url, proc = args.url, None
    else:
        from support.serverproc import ServerProcess

        proc = ServerProcess(args.model, "--slots", "2", "--ctx", str(args.tokens + 4096))
        url = proc.wait_ready(900)
    try:
        if proc is not None:
            print(f"floor: {floor(args.model):.2f}x plain (the head's multiply-adds)")
        kinds = {
            "plain": {},
            "echo": {"echo": True},
            "echo+logprobs 1": {"echo": True, "logprobs": 1},
            "echo+logprobs 5": {"echo": True, "logprobs": 5},
        }
        answer_s(url, 200)  # warm-up
        times: dict[str, list[float]] = {k: [] for k in kinds}
        n = 0
        for _ in range(args.rounds):  # the kinds take turns: the same host for each
            for kind, extra in kinds.items():
                t, n = answer_s(url, args.tokens, **extra)
                times[kind].append(t)
        base = statistics.median(times["plain"])
        for kind, ts in times.items():
            med = statistics.median(ts)
            print(
                f"{kind:16s} {n} prompt tokens: {med:.2f} s median of {len(ts)} "
                f"({min(ts):.2f}-{max(ts):.2f}), {med / base:.2f}x plain"
            )
        before, longest = stream_gaps(
            url, lambda: answer_s(url, args.tokens, echo=True, logprobs=5)
        )
        print(
            f"a stream beside one echo+logprobs 5 request: {before * 1e3:.0f} ms between "
            f"events before, {longest * 1e3:.0f} ms longest during"
        )
        before, longest = stream_gaps(url, lambda: answer_s(url, args.tokens))
        print(
            f"a stream beside one plain request: {before * 1e3:.0f} ms between events before, "
            f"{longest * 1e3:.0f} ms longest during"
        )
    finally:
        if proc is not None:
            proc.stop()


if __name__ == "__main__":
    main()
