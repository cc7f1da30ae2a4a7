"""Does mashbox's `/infill` answer as llama-server's does? The same bodies to both servers on
the same GGUF (a coder model), greedy, compared field by field.

    .venv/bin/python bench/infill_same_text.py --llama-server PATH/llama-server \
        [--model qwen2.5-coder-0.5b-instruct]

The bodies put the cursor at four places in one of mashbox's sources
(src/mashbox/text/stops.py: inside loops, after a method's first line, after a class line),
each with `n_indent` 0, 4, 8 and 12 (llama.vim and llama.vscode send the cursor line's
indentation), `n_predict` 48, and a chunk of another file in `input_extra`. Prints, for each,
whether `content`, `stop_type` and `tokens_predicted` agree, and the totals. llama-server
looks at a new line's indentation a token or two after the newline, so where `n_indent`
ends an answer it may have generated a token more than mashbox for the same text.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import decode_http  # noqa: F401 (puts tests/ on sys.path for serverproc)
import httpx
from vs_llama import one_slot_each

ROOT = Path(__file__).resolve().parent.parent
EDITED = ROOT / "src/mashbox/text/stops.py"
OTHER = ROOT / "src/mashbox/text/line_limits.py"
CURSORS = (
    "        for i in range(len(self._held), len(buf)):\n",
    "        fail = [0] * len(self._goto)\n",
    "    def flush(self) -> str:\n",
    "class StopMatcher:\n",
)
FIELDS = ["content", "stop_type", "tokens_predicted"]


def bodies() -> list[dict]:
    text = EDITED.read_text()
    extra = [{"filename": OTHER.name, "text": OTHER.read_text()[:1500]}]
    out = []
    for line in CURSORS:
        cursor = text.index(line) + len(line)
        for indent in (0, 4, 8, 12):
            out.append(
                {
                    "input_prefix": text[:cursor],
                    "input_suffix": text[cursor:][:400],
                    "input_extra": extra,
                    "n_predict": 48,
                    "temperature": 0,
                    "n_indent": indent,
                    "response_fields": FIELDS,
                }
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-server", type=Path, required=True)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    servers = one_slot_each(args.llama_server, args.model, 4096, args.threads, "infill-same")
    with servers as (mashbox_url, llama_url):
        agree = {f: 0 for f in FIELDS}
        cut = 0
        todo = bodies()
        with httpx.Client(timeout=600) as http:
            for body in todo:
                ours = http.post(mashbox_url + "/infill", json=body).json()
                theirs = http.post(llama_url + "/infill", json=body).json()
                same = {f: ours[f] == theirs[f] for f in FIELDS}
                for f in FIELDS:
                    agree[f] += same[f]
                cut += ours["tokens_predicted"] < 48 and ours["stop_type"] == "limit"
                print(
                    f"n_indent {body['n_indent']:2}: "
                    + ", ".join(f"{f} {'same' if same[f] else 'DIFFERS'}" for f in FIELDS)
                    + f" (tokens {ours['tokens_predicted']} / {theirs['tokens_predicted']},"
                    f" {ours['stop_type']} / {theirs['stop_type']}) ...{ours['content'][-40:]!r}"
                )
        print(
            f"\nof {len(todo)} bodies: "
            + ", ".join(f"{f} the same at {n}" for f, n in agree.items())
            + f"; n_indent ended {cut} of mashbox's answers early"
        )


if __name__ == "__main__":
    main()
