"""Do mashbox's llama-server routes answer as llama-server does? The same `/tokenize` (its
`content` form), `/detokenize` and `/apply-template` bodies to both servers on the same
GGUF, each answer compared whole; then one greedy `/completion`, its values and its keys.

    .venv/bin/python bench/llama_routes_same.py --llama-server PATH/llama-server \
        [--model qwen2.5-coder-0.5b-instruct]

The bodies: code; special tokens' texts read as tokens and, with `parse_special` false, as
text; the bos asked for; token ids and texts mixed; `with_pieces` over accents, an emoji
(pieces that are not UTF-8 alone) and CJK; chats of one and four turns, and one with a tool.
Token ids are the model's own (its special tokens', looked up through /tokenize).

Where a model's template has no tools (SmolLM2's), mashbox's chat route writes the tools
into a system turn of its own, and `/apply-template` shows that prompt; llama-server leaves
the tools out. That one body differs there, on purpose.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import decode_http  # noqa: F401 (puts tests/ on sys.path for serverproc)
import httpx
from vs_llama import one_slot_each

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def bodies(bos: str, eos: str, ids: dict[str, int]) -> list[tuple[str, dict]]:
    """(route, body) pairs; `ids` holds a few of the model's token ids by their text."""
    specials = f"Hello {bos}world{eos}"
    return [
        ("/tokenize", {"content": "def fib(n):\n    return n if n < 2 else fib(n-1) + fib(n-2)"}),
        ("/tokenize", {"content": specials}),
        ("/tokenize", {"content": specials, "parse_special": False}),
        ("/tokenize", {"content": "Hello", "add_special": True}),
        ("/tokenize", {"content": [ids[bos], "user\nhi", ids["\n"], " there"]}),
        ("/tokenize", {"content": "héllo wörld 😀 中文", "with_pieces": True}),
        ("/tokenize", {"content": [ids[bos], "x"], "with_pieces": True}),
        ("/tokenize", {"content": ""}),
        ("/detokenize", {"tokens": [ids[bos], ids["user"], ids["\n"], ids[eos]]}),
        ("/detokenize", {"tokens": [ids["Hello"], ids[" world"]]}),
        ("/apply-template", {"messages": [{"role": "user", "content": "Hi"}]}),
        (
            "/apply-template",
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Name three planets."},
                    {"role": "assistant", "content": "Mars, Venus, Earth."},
                    {"role": "user", "content": "More?"},
                ]
            },
        ),
        (
            "/apply-template",
            {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER]},
        ),
    ]


# A prompt whose greedy tokens lead by a margin: where the two likeliest are within ~0.03
# in log-prob ("def fib(n):" at its first token on qwen2.5-coder), the two servers' kernels,
# which round differently, can pick either, and the texts part there.
COMPLETION = {"prompt": "The capital of France is", "n_predict": 16, "temperature": 0}
SAME_VALUES = ["content", "tokens", "stop", "stop_type", "stopping_word", "tokens_evaluated"]


def compare_completion(http: httpx.Client, mashbox_url: str, llama_url: str) -> None:
    """One greedy /completion: the values that should agree, and the keys only one has."""
    ours = http.post(mashbox_url + "/completion", json=COMPLETION).json()
    theirs = http.post(llama_url + "/completion", json=COMPLETION).json()
    for key in SAME_VALUES:
        print(f"/completion {key:16s} {'same' if ours[key] == theirs[key] else 'DIFFERS'}")
    print(f"/completion keys only llama-server's: {sorted(set(theirs) - set(ours))}")
    print(f"/completion keys only mashbox's: {sorted(set(ours) - set(theirs))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-server", type=Path, required=True)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    servers = one_slot_each(args.llama_server, args.model, 2048, args.threads, "llama-routes-same")
    with servers as (mashbox_url, llama_url):
        with httpx.Client(timeout=600) as http:
            props = http.get(mashbox_url + "/props").json()
            bos, eos = props["bos_token"], props["eos_token"]

            def one_id(text: str) -> int:
                answer = http.post(mashbox_url + "/tokenize", json={"content": text}).json()
                (token,) = answer["tokens"]
                return token

            ids = {t: one_id(t) for t in (bos, eos, "\n", "user", "Hello", " world")}
            same, todo = 0, bodies(bos, eos, ids)
            for route, body in todo:
                ours = http.post(mashbox_url + route, json=body).json()
                theirs = http.post(llama_url + route, json=body).json()
                if route == "/detokenize":  # mashbox also answers vLLM's prompt
                    ours = {"content": ours["content"]}
                if route == "/tokenize":  # and vLLM's count and max_model_len
                    ours = {"tokens": ours["tokens"]}
                same += ours == theirs
                print(f"{route:15s} {json.dumps(body, ensure_ascii=False)[:60]:60s} ", end="")
                print(
                    "same" if ours == theirs else f"DIFFERS\n  mashbox {ours}\n  llama   {theirs}"
                )
            print(f"\nof {len(todo)} bodies: the same answer at {same}")
            compare_completion(http, mashbox_url, llama_url)


if __name__ == "__main__":
    main()
