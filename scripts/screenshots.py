"""Take screenshots of the MASHBOX Chat page into docs/ (a script, not a test).

    .venv/bin/python scripts/screenshots.py [--model smollm2-135m-instruct] [--out docs]

Starts a real `mashbox run MODEL --ui`, drives Debian's chromium (/usr/bin/chromium) with
Playwright, and writes:
  chat-empty.png      the page as first opened (dark theme)
  chat-streaming.png  a finished answer, then the next one mid-stream (light theme)
  chat-thinking.png   an answer with its thinking expanded (dark theme). The default model does
                      not think, so this reply is scripted (stubbed in the browser); its timings
                      are the real ones of the answer before it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from playwright.sync_api import expect, sync_playwright

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from serverproc import ServerProcess  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip

QUESTION = "Is 1001 a prime number?"
REASONING = (
    "1001 is odd, so 2 does not divide it. Its digit sum is 2, so 3 does not either, and it "
    "does not end in 0 or 5.\n\nTry 7: 7 × 143 = 1001. So it is not prime. And 143 = 11 × 13, "
    "so 1001 = 7 × 11 × 13."
)
ANSWER = """No: **1001 is not prime**. It factors as

| factor | × | gives |
|---|---|---|
| 7 | 143 | 1001 |
| 11 | 13 | 143 |

so `1001 = 7 × 11 × 13`. A quick check in Python:

```python
def is_prime(n: int) -> bool:
    if n < 2:
        return False
    i = 2
    while i * i <= n:
        if n % i == 0:
            return False  # found a factor
        i += 1
    return True

print(is_prime(1001))  # False
```
"""


def scripted_stream(timings: dict | None) -> list[str]:
    """The SSE body of the scripted thinking answer, in chunks as the server sends them."""
    base = {"id": "chatcmpl-shot", "object": "chat.completion.chunk", "created": 0, "model": "m"}

    def chunk(delta, finish=None, **extra):
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return "data: " + json.dumps({**base, "choices": [choice], **extra}) + "\n\n"

    parts = [chunk({"role": "assistant", "content": ""})]
    parts += [
        chunk({"reasoning_content": REASONING[i : i + 4]}) for i in range(0, len(REASONING), 4)
    ]
    parts += [chunk({"content": ANSWER[i : i + 4]}) for i in range(0, len(ANSWER), 4)]
    parts.append(chunk({}, "stop", timings=timings))
    parts.append("data: [DONE]\n\n")
    return parts


# Replaces the page's fetch of the chat route with a stream of the scripted chunks, one every
# 15 ms, so the page sees a real stream (and times the thinking) without a thinking model.
STUB_FETCH = """(parts) => {
  const real = window.fetch;
  window.fetch = (url, init) => {
    if (!String(url).includes('/v1/chat/completions')) return real(url, init);
    const encoder = new TextEncoder();
    const stream = new ReadableStream({ async start(controller) {
      for (const part of parts) {
        controller.enqueue(encoder.encode(part));
        await new Promise((resolve) => setTimeout(resolve, 15));
      }
      controller.close();
    } });
    const headers = { 'Content-Type': 'text/event-stream' };
    return Promise.resolve(new Response(stream, { headers }));
  };
}"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    server = ServerProcess(args.model, "--ctx", "2048", "--slots", "2", "--ui")
    try:
        url = server.wait_ready(900).replace("127.0.0.1", "localhost")
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 860})
            page.emulate_media(color_scheme="dark")
            page.goto(url + "/")
            expect(page.locator("#status")).to_have_attribute("data-state", "ready")
            page.wait_for_timeout(300)
            page.screenshot(path=args.out / "chat-empty.png")
            print("wrote", args.out / "chat-empty.png")

            page.emulate_media(color_scheme="light")
            page.click("#open-settings")
            page.fill("#temperature-value", "0.2")
            page.fill("#max-tokens", "400")
            page.fill("#system", "You are a helpful assistant. Answer concisely.")
            page.click("#close-settings")
            page.wait_for_timeout(300)
            ask(page, "Explain what a CPU cache is in a short paragraph.")
            expect(page.locator(".msg.assistant .meta .tps")).to_be_visible(timeout=300_000)
            ask(page, "Write a Python function that merges two sorted lists, in a code block.")
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and page.locator("#stop").is_visible():
                shown = page.evaluate(
                    "[...document.querySelectorAll('.msg.assistant .body')].pop().textContent"
                )
                if len(shown) > 70:
                    break
                time.sleep(0.1)
            page.screenshot(path=args.out / "chat-streaming.png")
            print("wrote", args.out / "chat-streaming.png")
            page.click("#stop")
            expect(page.locator("#send")).to_be_visible()

            chats = page.evaluate("JSON.parse(localStorage.getItem('mashbox.chats.v1'))")
            timings = next(
                (m["timings"] for c in chats["chats"] for m in c["messages"] if m.get("timings")),
                None,
            )
            page.evaluate(STUB_FETCH, scripted_stream(timings))
            page.click("#theme")  # system -> light
            page.click("#theme")  # light -> dark
            page.click("#new-chat")
            page.click("#think")
            ask(page, QUESTION)
            expect(page.locator(".msg.assistant .meta .tps")).to_be_visible(timeout=30_000)
            page.click(".msg.assistant .think summary")
            page.evaluate("document.getElementById('messages').scrollTop = 0")
            page.mouse.move(0, 0)
            page.wait_for_timeout(300)
            page.screenshot(path=args.out / "chat-thinking.png")
            print("wrote", args.out / "chat-thinking.png")
            browser.close()
    finally:
        server.stop()
    return 0


def ask(page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


if __name__ == "__main__":
    raise SystemExit(main())
