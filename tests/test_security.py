"""Keys, tenants, Host and Origin rules, and hostile request bodies, through real servers."""

from __future__ import annotations

import json

import httpx
import pytest
import trio

from mashbox.server.security import Guard, read_key_file
from support.serverproc import ServerProcess, serving

CHAT = "/v1/chat/completions"
SMALL = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@pytest.fixture(scope="module")
def keyed(tiny_llama, tmp_path_factory):
    """Keys from a key file: two keys of tenant alice, one unnamed key; one slot, slow steps."""
    folder = tmp_path_factory.mktemp("keys")
    keyfile = folder / "keys"
    keyfile.write_text("# keys\nk-alice-1 alice\nk-alice-2 alice  # laptop\n\nk-bob\n")
    with serving(
        str(tiny_llama), "--ctx", "2048", "--slots", "1", "--api-key-file", str(keyfile),
        "--allowed-host", "mashbox.example", env={"MASHBOX_FAULTS": "slow=0.02"},
    ) as proc:  # fmt: skip
        yield proc


def test_key_file_format(tmp_path):
    path = tmp_path / "k"
    path.write_text("a t1\nb t1\nsecret-c\n# d\n")
    keys = read_key_file(path)
    assert keys["a"] == keys["b"] == "t1"
    assert keys["secret-c"].startswith("key-") and "secret" not in keys["secret-c"]
    path.write_text("a b c\n")
    with pytest.raises(ValueError):
        read_key_file(path)


def test_host_rules():
    g = Guard("127.0.0.1", allowed_hosts=frozenset({"box.lan"}))
    for host in ("localhost:8000", "127.0.0.1", "[::1]:9", "box.lan:1", "LOCALHOST"):
        assert g.host_allowed(host), host
    for host in ("evil.com", "127.0.0.1.evil.com", "", None, "10.0.0.1"):
        assert not g.host_allowed(host), host
    wildcard = Guard("0.0.0.0", keys={"k": "t"})
    assert wildcard.host_allowed("192.0.2.7:8000") and not wildcard.host_allowed("evil.com")


def test_loopback_without_keys_ignores_any_key(server):
    r = httpx.post(server.url + CHAT, json=SMALL, headers={"Authorization": "Bearer nonsense"})
    assert r.status_code == 200


def test_keys_are_required_on_v1_metrics_and_openapi(keyed):
    url = keyed.url
    for method, path in [("GET", "/v1/models"), ("GET", "/v1/health"), ("GET", "/metrics"),
                         ("GET", "/openapi.json"), ("POST", CHAT)]:  # fmt: skip
        r = httpx.request(method, url + path, json=SMALL if method == "POST" else None)
        assert r.status_code == 401, path
        assert r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(url + "/v1/messages", json=SMALL)
    assert r.status_code == 401
    assert r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(url + "/health").status_code == 200  # local probes need no key
    assert httpx.get(url + "/").status_code == 200
    wrong = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer k-alice-3"})
    assert wrong.status_code == 401
    for headers in ({"Authorization": "Bearer k-alice-1"}, {"x-api-key": "k-alice-2"},
                    {"x-privy-token": "k-bob"}):  # fmt: skip
        assert httpx.get(url + "/v1/models", headers=headers).status_code == 200
    assert all("k-alice" not in line and "k-bob" not in line for line in keyed.lines)


def test_every_route_but_the_probes_needs_a_key(keyed):
    """Read off the server's own routing table, so a route added later (as /tokenize and
    /infill were, outside /v1, and open by omission until this test) cannot be missed."""
    table = httpx.get(keyed.url + "/v1/capabilities").json()["routes"]
    routes = {(r["method"], r["path"].replace("{model}", "any")) for r in table}
    open_routes = {"/", "/health", "/health/live", "/v1/capabilities"}
    open_routes.add("/v1/chat/completions/ws")  # a plain GET is a 426; its handshake's key:
    # test_chat_ws
    checked = 0
    for method, path in sorted(routes):
        if path in open_routes or method == "HEAD":  # HEAD anywhere: the ready check
            continue
        r = httpx.request(method, keyed.url + path, json={} if method == "POST" else None)
        assert r.status_code == 401, (method, path, r.status_code)
        checked += 1
    assert checked >= 15 and ("POST", "/infill") in routes and ("POST", "/tokenize") in routes


async def test_keys_naming_one_tenant_share_its_queue(keyed):
    url = keyed.url
    alice1, alice2, bob = (
        {"Authorization": f"Bearer {k}"} for k in ("k-alice-1", "k-alice-2", "k-bob")
    )
    long = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1500,
            "ignore_eos": True, "stream": True}  # fmt: skip
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        async with trio.open_nursery() as nursery:

            async def hold():
                async with http.stream("POST", CHAT, json=long, headers=bob) as r:
                    async for _ in r.aiter_lines():
                        pass

            nursery.start_soon(hold)
            await trio.sleep(0.5)
            for i in range(32):
                headers = alice1 if i % 2 else alice2
                nursery.start_soon(lambda h=headers: http.post(CHAT, json=SMALL, headers=h))
            await trio.sleep(1.0)
            over = await http.post(CHAT, json=SMALL, headers=alice1)
            assert over.status_code == 429  # alice's 32 are waiting, whichever key sent them
            assert over.headers["Retry-After"]
            # bob is another tenant: his request is queued, not refused.
            nursery.start_soon(lambda: http.post(CHAT, json=SMALL, headers=bob))
            await trio.sleep(0.3)
            health = (await http.get("/health", headers=bob)).json()  # the depth: key holders only
            assert health["waiting"] == 33
            nursery.cancel_scope.cancel()


def test_env_key_and_non_loopback_bind(tiny_llama):
    refused = ServerProcess(str(tiny_llama), "--host", "0.0.0.0", "--ctx", "64")
    assert refused.wait_exit(60) == 1
    assert any("without an API key" in line for line in refused.lines)
    refused.stop()
    proc = ServerProcess(
        str(tiny_llama), "--host", "0.0.0.0", "--ctx", "64", env={"MASHBOX_API_KEY": "env-key"}
    )
    try:
        url = proc.wait_ready(120).replace("0.0.0.0", "127.0.0.1")
        assert httpx.get(url + "/v1/models").status_code == 401
        ok = httpx.get(url + "/v1/models", headers={"x-api-key": "env-key"})
        assert ok.status_code == 200
    finally:
        proc.stop()


def test_host_header_rules(keyed):
    key = {"x-api-key": "k-bob"}
    for host, status in [("evil.example", 403), ("localhost:4444", 200),
                         ("mashbox.example", 200), ("127.0.0.1.nip.io", 403)]:  # fmt: skip
        r = httpx.get(keyed.url + "/v1/models", headers={**key, "Host": host})
        assert r.status_code == status, host
    assert httpx.get(keyed.url + "/health", headers={"Host": "evil.example"}).status_code == 200
    # No host name at all (werkzeug cannot bind routes to it): a 400 in the route's shape,
    # never the 500 fuzz/test_guarded.py found.
    for host in (".", "a..b", "x" * 64):
        r = httpx.get(keyed.url + "/", headers={"Host": host})
        assert r.status_code == 400 and "Host header" in r.json()["error"]["message"]
        r = httpx.post(keyed.url + "/v1/messages", json={}, headers={**key, "Host": host})
        assert r.status_code == 400 and r.json()["type"] == "error"
        assert httpx.head(keyed.url + "/v1/models", headers={"Host": host}).status_code == 400


def test_origin_rules(server):
    url = server.url
    host = url.removeprefix("http://")
    for origin, status in [("http://evil.example", 403), (f"http://{host}", 200), ("null", 403),
                           ("http://localhost:1", 403)]:  # fmt: skip
        r = httpx.get(url + "/v1/models", headers={"Origin": origin})
        assert r.status_code == status, origin
    # Through a tunnel the page's own origin is whatever host:port the browser used.
    r = httpx.get(url + "/v1/models", headers={"Origin": "http://localhost:9000",
                                               "Host": "localhost:9000"})  # fmt: skip
    assert r.status_code == 200
    r = httpx.post(url + "/v1/messages", json=SMALL, headers={"Origin": "http://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"


@pytest.mark.parametrize(
    ("content", "status"),
    [
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}', 200),
        (b"[" * 100000 + b"]" * 100000, 400),  # deep nesting
        (b'{"messages": [], "temperature": 1e999}', 400),
        (b'{"messages": [], "max_tokens": ' + b"9" * 5000 + b"}", 400),  # huge integer
        (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400),  # invalid UTF-8
        (b'{"messages": [{"role": "user", "content": "a\\u0000b"}], "max_tokens": 1}', 200),
        (b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 1}', 400),
        (b'{"messages": [{"role": "user", "content": 12}]}', 400),
        (b'{"messages": [{"role": "user", "content": ["x"]}]}', 400),
        (b'{"messages": [null]}', 400),
        (b"null", 400),
        (b"", 400),
    ],
)
def test_hostile_bodies_get_4xx_never_5xx(server, content, status):
    r = httpx.post(server.url + CHAT, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text[:200]
    if status == 400:
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_enormous_bodies(server):
    big = json.dumps({"messages": [{"role": "user", "content": "a" * (17 * 1024 * 1024)}]})
    r = httpx.post(
        server.url + CHAT, content=big.encode(), headers={"content-type": "application/json"}
    )
    assert r.status_code == 413 and "error" in r.json()
    long = {"messages": [{"role": "user", "content": "Paris " * 300000}], "max_tokens": 1}
    r = httpx.post(server.url + CHAT, json=long, timeout=120)
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_content_type_after_routing_and_head_everywhere(server):
    url = server.url
    assert (
        httpx.request(
            "GET", url + CHAT, content=b"x", headers={"content-type": "text/plain"}
        ).status_code
        == 405
    )
    assert (
        httpx.post(url + CHAT, content=b"{}", headers={"content-type": "text/plain"}).status_code
        == 415
    )
    assert httpx.post(url + CHAT, content=b"{}").status_code == 415
    for path in ("/", "/health", "/v1/health", "/v1/models", "/metrics", "/openapi.json"):
        r = httpx.head(url + path)
        assert r.status_code == 200 and r.content == b"", path
    # Seed 000: "The server answers HEAD the same way on every path" (the ready check).
    r = httpx.head(url + CHAT)
    assert r.status_code == 200 and r.content == b""


async def test_the_whole_queue_holds_256_then_429_and_anthropic_529(tiny_llama, tmp_path):
    keyfile = tmp_path / "keys"
    keyfile.write_text("".join(f"key-{i} tenant{i}\n" for i in range(10)))
    proc = ServerProcess(
        str(tiny_llama), "--ctx", "2048", "--slots", "1", "--api-key-file", str(keyfile),
        env={"MASHBOX_FAULTS": "slow=0.05"},
    )  # fmt: skip
    try:
        url = proc.wait_ready(120)
        auth = [{"x-api-key": f"key-{i}"} for i in range(10)]
        long = {**SMALL, "max_tokens": 1500, "ignore_eos": True, "stream": True}
        limits = httpx.Limits(max_connections=400)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
            async with trio.open_nursery() as nursery:

                async def hold():
                    async with http.stream("POST", CHAT, json=long, headers=auth[9]) as r:
                        async for _ in r.aiter_lines():
                            pass

                nursery.start_soon(hold)
                await trio.sleep(0.5)
                for i in range(256):  # 8 tenants x 32
                    headers = auth[i % 8]
                    nursery.start_soon(lambda h=headers: http.post(CHAT, json=SMALL, headers=h))
                while (await http.get("/health", headers=auth[0])).json()["waiting"] < 256:
                    await trio.sleep(0.05)
                r = await http.post(CHAT, json=SMALL, headers=auth[8])
                assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
                m = await http.post("/v1/messages", json=SMALL, headers=auth[8])
                assert m.status_code == 529 and m.headers["Retry-After"]
                assert m.json()["error"]["type"] == "overloaded_error"
                nursery.cancel_scope.cancel()
    finally:
        proc.stop()


def test_systemone_auth_errors_in_seed_004s_shape_with_a_detail_object(keyed):
    """TypeSafe's clients read a 401's detail.error_type and detail.message; seed 004's
    `error` (message, code) is there too. Validation errors keep FastAPI's detail list."""
    question = {"type": "noul", "instructions": "?"}
    body = {"model": "jev-latest", "state": "s", "questions": {"q": question}}
    r = httpx.post(keyed.url + "/v1/systemone", json=body)
    assert r.status_code == 401
    error = r.json()
    assert error["error"]["code"] == "validation" and error["error"]["message"]
    detail = {"error_type": "authentication_error", "message": error["error"]["message"]}
    assert error["detail"] == detail
    other = {**body, "model": "other"}
    r = httpx.post(keyed.url + "/v1/systemone", json=other, headers={"x-api-key": "k-bob"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "unknown_model"
    assert isinstance(r.json()["detail"], list)
