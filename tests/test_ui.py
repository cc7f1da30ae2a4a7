"""The MASHBOX Chat page (`mashbox run --ui`) in a real headless Chromium against a real server.

Debian's chromium (/usr/bin/chromium, installed by scripts/setup.sh) is driven by Playwright's
Python package; no browser is downloaded. The server requires a key (MASHBOX_API_KEY), so every
page goes through the key rules, and is reached as `localhost:PORT`, as through an SSH tunnel.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import httpx
import pytest

from support.serverproc import serving, wait_for

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
KEY = "k-ui-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = "/v1/chat/completions"

try:
    from playwright.sync_api import expect, sync_playwright
except ImportError:  # pragma: no cover - setup.sh installs it
    sync_playwright = None


def live_rows(url: str) -> int:
    return httpx.get(url + "/health", headers=AUTH, timeout=10).json()["live_rows"]


@pytest.fixture(scope="module")
def ui_server(tiny_llama, tmp_path_factory):
    """`mashbox run --ui` with a key required; 50 ms engine steps, so answers stream visibly."""
    with serving(
        str(tiny_llama), "--ctx", "512", "--slots", "2", "--threads", "1", "--ui",
        env={"MASHBOX_FAULTS": "slow=0.05", "MASHBOX_API_KEY": KEY},
        log=tmp_path_factory.mktemp("ui") / "server.log",
    ) as proc:  # fmt: skip
        yield proc


@pytest.fixture(scope="module")
def tunnel_url(ui_server) -> str:
    """The server as a browser sees it through `ssh -L PORT:127.0.0.1:PORT`."""
    return ui_server.url.replace("127.0.0.1", "localhost")


@pytest.fixture(scope="module")
def browser():
    if sync_playwright is None or not Path(CHROMIUM).exists():
        message = f"needs the playwright package and {CHROMIUM} (bash scripts/setup.sh)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser, tunnel_url, tiny_llama):
    """A fresh browser profile on the page, the key already in this tab's sessionStorage."""
    context = browser.new_context(viewport={"width": 1200, "height": 800})
    context.add_init_script(f"sessionStorage.setItem('mashbox.key', {json.dumps(KEY)})")
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(tunnel_url + "/")
    expect(page.locator("#model-id")).to_have_text(tiny_llama.name, timeout=10_000)
    yield page
    context.close()
    assert errors == []


def settings(page, *, temperature=None, max_tokens=None, extra=None) -> None:
    page.click("#open-settings")
    if temperature is not None:
        page.fill("#temperature-value", str(temperature))
    if max_tokens is not None:
        page.fill("#max-tokens", str(max_tokens))
    if extra is not None:
        page.fill("#extra", json.dumps(extra))
    page.click("#close-settings")


def send(page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def answer_text(page) -> str:
    return page.evaluate("[...document.querySelectorAll('.msg.assistant .body')].pop().textContent")


def stored_chats(page) -> dict:
    return page.evaluate("JSON.parse(localStorage.getItem('mashbox.chats.v1'))")


# --- serving ---------------------------------------------------------------------------------


def test_root_is_health_without_ui_and_the_page_with_it(server, ui_server):
    plain = httpx.get(server.url + "/")
    assert plain.headers["content-type"].startswith("application/json")
    assert plain.json()["status"] == "ok"

    url = ui_server.url
    r = httpx.get(url + "/")
    assert r.status_code == 200 and r.headers["content-type"] == "text/html; charset=utf-8"
    assert "MASHBOX Chat" in r.text
    csp = r.headers["content-security-policy"]
    assert "script-src 'sha256-" in csp and "unsafe-inline" not in csp
    assert "connect-src 'self'" in csp and "default-src 'none'" in csp
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", r.text)  # nothing from elsewhere
    head = httpx.head(url + "/")
    assert head.status_code == 200 and head.content == b""
    for path in ("/health", "/v1/health"):
        assert httpx.get(url + path, headers=AUTH).json()["status"] == "ok"
    assert httpx.get(url + "/v1/health").status_code == 401  # the key rules still hold

    # Through a tunnel the page is http://localhost:PORT and its requests are same-origin.
    port = url.rsplit(":", 1)[1]
    tunnel = {"Host": f"localhost:{port}", "Origin": f"http://localhost:{port}", **AUTH}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    assert httpx.post(url + CHAT, json=body, headers=tunnel).status_code == 200
    elsewhere = {**tunnel, "Origin": "http://evil.example"}
    assert httpx.post(url + CHAT, json=body, headers=elsewhere).status_code == 403


# --- the page --------------------------------------------------------------------------------


def test_answer_streams_token_by_token(page, ui_server):
    settings(page, temperature=0, max_tokens=24)
    send(page, "Hello there")
    expect(page.locator("#stop")).to_be_visible()
    lengths = []
    while page.locator("#stop").is_visible():
        lengths.append(len(answer_text(page)))
        foot = page.locator(".msg.assistant .foot").text_content()
        assert "null" not in foot and "undefined" not in foot
        time.sleep(0.05)
    growing = sorted(set(n for n in lengths if n))
    assert len(growing) >= 3, lengths  # the text arrived in pieces, not at once

    body = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 24}
    body["temperature"] = 0
    direct = httpx.post(ui_server.url + CHAT, json=body, headers=AUTH, timeout=60).json()
    meta = page.locator(".msg.assistant .meta")
    expect(meta.locator(".tps")).to_have_text(re.compile(r"^\d+\.\d tok/s$"))
    expect(meta.locator(".ttft")).to_have_text(re.compile(r"to first token$"))
    expect(meta.locator(".tokens")).to_have_text(f"{direct['usage']['completion_tokens']} tokens")
    expect(page.locator("#send")).to_be_visible()
    expect(page.locator(".msg.assistant .regenerate")).to_be_visible()
    expect(page.locator(".msg.user .bubble")).to_have_text("Hello there")

    # The page shows exactly what the API answers to the same (greedy) request.
    (chat,) = stored_chats(page)["chats"]
    shown = chat["messages"][1]["content"]
    assert shown == direct["choices"][0]["message"]["content"]
    assert answer_text(page).strip()


def test_stop_and_regenerate_free_the_slot(page, ui_server):
    settings(page, max_tokens=400, extra={"ignore_eos": True})
    send(page, "Tell me a long story")
    wait_for(lambda: len(answer_text(page)) > 0, timeout=20)
    assert live_rows(ui_server.url) == 1
    page.click("#stop")
    t0 = time.monotonic()
    wait_for(lambda: live_rows(ui_server.url) == 0, timeout=3)
    assert time.monotonic() - t0 < 3  # 400 steps of 50 ms would take 20 s
    expect(page.locator(".msg.assistant .meta .stopped")).to_be_visible()
    expect(page.locator("#send")).to_be_visible()
    stopped = answer_text(page)
    time.sleep(0.3)
    assert answer_text(page) == stopped

    page.click(".msg.assistant .regenerate")  # the answer again, from the same question
    expect(page.locator("#stop")).to_be_visible()
    wait_for(lambda: len(answer_text(page)) > 0, timeout=20)
    assert page.locator(".msg.assistant").count() == 1
    page.keyboard.press("Escape")  # Escape stops too
    wait_for(lambda: live_rows(ui_server.url) == 0, timeout=3)
    expect(page.locator(".msg.assistant .meta .stopped")).to_be_visible()


def test_conversations_survive_a_reload(page):
    settings(page, max_tokens=4)
    send(page, "The first conversation")
    expect(page.locator(".msg.assistant .meta .tps")).to_be_visible(timeout=20_000)
    page.click("#new-chat")
    expect(page.locator(".empty")).to_be_visible()
    send(page, "The second conversation")
    expect(page.locator(".msg.assistant .meta .tps")).to_be_visible(timeout=20_000)

    page.reload()
    items = page.locator(".chat-item .chat-title")
    expect(items).to_have_text(["The second conversation", "The first conversation"])
    expect(page.locator(".msg.user .bubble")).to_have_text("The second conversation")
    page.click(".chat-item:has-text('The first conversation') .chat-open")
    expect(page.locator(".msg.user .bubble")).to_have_text("The first conversation")
    expect(page.locator(".msg.assistant .meta .tps")).to_be_visible()
    expect(page.locator("#chat-title")).to_have_text("The first conversation")


HOSTILE = (
    "Hi <script>window.__pwned = 1; alert(1)</script>\n\n"
    '<img src=x onerror="window.__pwned = 2; alert(2)">\n\n'
    "[click me](javascript:alert(3)) and **bold** and `<b>code</b>`\n\n"
    "[mail me](mailto:x@evil.example) and [docs](https://example.com/docs)\n\n"
    "```html\n<script>alert(4)</script>\n```\n"
)


def sse_body(*deltas, timings=None) -> str:
    base = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    events = [
        {**base, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas
    ]
    events.append(
        {
            **base,
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
            "timings": timings,
        }
    )
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def test_model_output_is_text_never_html(page):
    """A stubbed stream carrying markup: it must show up literally and run nothing."""
    timings = {
        "prompt_n": 9,
        "prompt_ms": 12.5,
        "prompt_per_second": 720.0,
        "predicted_n": 5,
        "predicted_ms": 50.0,
        "predicted_per_second": 100.0,
        "cache_n": 0,
        "queue_ms": 0.2,
    }
    arguments = json.dumps({"city": "<img src=x onerror=alert(5)>"})
    call = {
        "index": 0,
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    requests = []

    def fulfill(route):
        requests.append((route.request.post_data_json, route.request.headers))
        body = sse_body(
            {"role": "assistant", "content": ""},
            {"reasoning_content": "<b>not bold</b> thinking"},
            *({"content": HOSTILE[i : i + 7]} for i in range(0, len(HOSTILE), 7)),
            {"tool_calls": [call]},
            timings=timings,
        )
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=body)

    dialogs = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.route("**" + CHAT, fulfill)
    page.click("#think")
    send(page, "Show me some HTML")
    expect(page.locator(".msg.assistant .meta .tps")).to_have_text("100.0 tok/s")

    ((sent, headers),) = requests
    assert sent["chat_template_kwargs"] == {"enable_thinking": True}
    assert sent["stream"] is True and sent["messages"][-1]["content"] == "Show me some HTML"
    assert headers["authorization"] == f"Bearer {KEY}"

    answer = page.locator(".msg.assistant .body")
    text = answer.inner_text()
    assert "<script>window.__pwned = 1; alert(1)</script>" in text
    assert '<img src=x onerror="window.__pwned = 2; alert(2)">' in text
    assert "[click me](javascript:alert(3))" in text  # not a link
    assert "[mail me](mailto:x@evil.example)" in text  # http(s) links only
    expect(answer.locator("a[href='https://example.com/docs']")).to_have_text("docs")
    expect(answer.locator("strong")).to_have_text("bold")
    expect(answer.locator("p code")).to_have_text("<b>code</b>")
    expect(answer.locator(".codeblock pre")).to_have_text("<script>alert(4)</script>")
    thinking = page.locator(".msg.assistant .think")
    expect(thinking.locator(".think-body")).to_have_text("<b>not bold</b> thinking")
    assert thinking.get_attribute("open") is None  # collapsed once the answer came
    thinking.locator("summary").click()
    expect(thinking.locator(".think-body")).to_be_visible()
    tool = page.locator(".msg.assistant .tool")
    expect(tool.locator(".tool-head code")).to_have_text("get_weather")
    expect(tool.locator(".tool-args")).to_contain_text('"city": "<img src=x onerror=alert(5)>"')

    thread = page.locator("#thread")
    assert thread.locator("img, script, b, a[href^='javascript'], a[href^='mailto']").count() == 0
    assert page.evaluate("window.__pwned") is None
    page.wait_for_timeout(200)
    assert dialogs == []


def test_key_is_asked_for_and_kept_for_the_session_only(browser, tunnel_url, tiny_llama):
    context = browser.new_context()
    page = context.new_page()
    try:
        page.goto(tunnel_url + "/")
        dialog = page.locator("#key-dialog")
        expect(dialog).to_be_visible()  # /v1/models answered 401
        page.fill("#key-input", "not-the-key")
        page.press("#key-input", "Enter")
        expect(dialog.locator(".refused")).to_be_visible()
        page.fill("#key-input", KEY)
        page.press("#key-input", "Enter")
        expect(dialog).to_be_hidden()
        expect(page.locator("#model-id")).to_have_text(tiny_llama.name)
        assert page.evaluate("sessionStorage.getItem('mashbox.key')") == KEY
        kept = page.evaluate("JSON.stringify(Object.assign({}, localStorage))")
        assert KEY not in kept
    finally:
        context.close()
