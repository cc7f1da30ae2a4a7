"""An editor's completions as the user types: llama-server's `/infill`, mashbox against
llama-server on the same GGUF (a coder model with fill-in-the-middle markers).

    .venv/bin/python bench/infill_keystrokes.py --llama-server PATH/llama-server \
        [--model qwen2.5-coder-0.5b-instruct] [--keys 12] [--rounds 2]

The file being edited is one of mashbox's own sources (src/mashbox/scheduler.py), the cursor
in its middle; two other sources give `input_extra` chunks as llama.vscode sends them. The
user types the file's own next characters one at a time: each keystroke is an /infill with
the longer prefix (`n_predict` 16, greedy, llama.vscode's other fields: `n_indent` the cursor
line's indentation; not its `t_max_predict_ms`, which would make the texts depend on each
server's speed), sent after the last one's answer. The first keystroke finds nothing
cached; later ones reuse the prompt's start, so a keystroke's time is the new tokens'
prefill and at most 16 tokens' decode. The servers take turns (the order flipping each
round, the idle one idle). Prints each server's median keystroke time (first keystroke
apart) and the ratio (llama-server / mashbox: above 1, mashbox answers sooner), and whether
the two wrote the same text (greedy; a near-tie may part them).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import decode_http  # noqa: F401 (puts tests/ on sys.path for serverproc)
import httpx
from vs_llama import one_slot_each

ROOT = Path(__file__).resolve().parent.parent
EDITED = ROOT / "src/mashbox/scheduler.py"
OTHERS = [ROOT / "src/mashbox/batch.py", ROOT / "src/mashbox/events.py"]


def editor_bodies(keys: int, chunk_lines: int = 64) -> list[dict]:
    """The /infill bodies of `keys` keystrokes, llama.vscode's shape."""
    text = EDITED.read_text()
    cursor = text.index("\n", len(text) // 2) + 1
    extra = []
    for path in OTHERS:
        lines = path.read_text().splitlines(keepends=True)
        for start in range(0, min(len(lines), 2 * chunk_lines), chunk_lines):
            chunk = "".join(lines[start : start + chunk_lines])
            extra.append({"filename": path.name, "text": chunk})
    bodies = []
    for k in range(keys):
        line = text[text.rindex("\n", 0, cursor + k) + 1 :].split("\n", 1)[0]
        bodies.append(
            {
                "input_prefix": text[: cursor + k],
                "input_suffix": text[cursor + k :][:2000],
                "input_extra": extra,
                "prompt": "",
                "n_predict": 16,
                "temperature": 0,
                # llama.vscode also sends samplers [top_k, top_p, infill] without the
                # temperature, which makes llama-server sample; left out, both are greedy.
                "cache_prompt": True,
                "n_indent": len(line) - len(line.lstrip()),  # the cursor line's, as llama.vscode
                "response_fields": ["content", "timings/prompt_n", "tokens_predicted"],
            }
        )
    return bodies


def session(body: dict, n: int) -> dict:
    """The body with a first line of its own in every chunk and in the edited file."""
    line = f"# session {n}\n"
    extra = [c | {"text": line + c["text"]} for c in body["input_extra"]]
    return body | {"input_extra": extra, "input_prefix": line + body["input_prefix"]}


def type_through(url: str, bodies: list[dict]) -> tuple[list[float], list[str], list[int]]:
    """Each keystroke's seconds, text and prompt tokens computed (and tokens written)."""
    seconds, texts, computed, written = [], [], [], []
    with httpx.Client(timeout=600) as http:
        for body in bodies:
            t0 = time.perf_counter()
            r = http.post(url + "/infill", json=body)
            seconds.append(time.perf_counter() - t0)
            r.raise_for_status()
            answer = r.json()
            texts.append(answer["content"])
            computed.append(answer.get("timings/prompt_n", -1))
            written.append(answer.get("tokens_predicted", -1))
    print(f"  {url}: tokens written a keystroke {written}")
    return seconds, texts, computed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-server", type=Path, required=True)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--keys", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    servers = one_slot_each(args.llama_server, args.model, args.ctx, args.threads, "infill-bench")
    with servers as (mashbox_url, llama_url):
        urls = {"mashbox": mashbox_url, "llama-server": llama_url}
        firsts, later, texts = {n: [] for n in urls}, {n: [] for n in urls}, {}
        for rnd in range(args.rounds):
            # Each round a session neither server has seen: its first line is new, in the
            # chunks and the file, so the first keystroke finds nothing cached.
            bodies = [session(b, rnd) for b in editor_bodies(args.keys)]
            order = list(urls) if rnd % 2 == 0 else list(reversed(urls))
            for name in order:
                seconds, text, computed = type_through(urls[name], bodies)
                firsts[name].append(seconds[0])
                later[name] += seconds[1:]
                texts[name] = text
                print(
                    f"round {rnd + 1} {name}: first {seconds[0]:.2f} s, then median "
                    f"{statistics.median(seconds[1:]) * 1e3:.0f} ms; prompt tokens computed "
                    f"{computed[0]} then {statistics.median(computed[1:]):.0f}"
                )
        print("\n| | mashbox | llama-server | ratio |")
        print("|---|---|---|---|")
        for label, data in (("first keystroke, s", firsts), ("later keystrokes, s", later)):
            m, b = statistics.median(data["mashbox"]), statistics.median(data["llama-server"])
            print(f"| {label} | {m:.3f} | {b:.3f} | {b / m:.2f}x |")
        same = sum(a == b for a, b in zip(texts["mashbox"], texts["llama-server"], strict=True))
        print(f"\nthe same text at {same} of {args.keys} keystrokes (greedy, last round)")


if __name__ == "__main__":
    main()
