"""/metrics through a real `mashbox run`, read with prometheus-client's own parser.

The session server is shared with other tests: every check measures the change around its own
requests, sent one at a time once the server is idle.
"""

from __future__ import annotations

import time

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from mashbox.prompt_cache import DEFAULT_CACHE_RAM_MIB
from mashbox.protocol import EngineInfo
from mashbox.server.app import create_app
from mashbox.server.identity import model_identity, weights_sha
from mashbox.server.state import ServerState
from support.serverproc import serving

MODEL = "tiny-llama.gguf"
COUNTERS = [
    "request_success",
    "prompt_tokens",
    "generation_tokens",
    "forward_passes",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
    "worker_restarts",
]
GAUGES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"]
HISTOGRAMS = [
    "time_to_first_token_seconds",
    "request_queue_time_seconds",
    "e2e_request_latency_seconds",
    "time_per_output_token_seconds",
]


def parse(text: str) -> dict:
    """{(sample name, sorted label items): value} of every sample."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(url: str) -> dict:
    r = httpx.get(url + "/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    return parse(r.text)


def value(samples: dict, name: str, **labels) -> float:
    key = (f"mashbox:{name}", tuple(sorted({"model_name": MODEL, **labels}.items())))
    return samples[key]


def wait_idle(url: str, timeout: float = 30) -> dict:
    """Scrape until nothing runs or waits (another test's request may still be ending)."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(url)
        busy = value(samples, "num_requests_running") + value(samples, "num_requests_waiting")
        if not busy:
            return samples
        assert time.monotonic() < deadline, "the server did not become idle"
        time.sleep(0.05)


def test_names_labels_and_cache_layout(server):
    text = httpx.get(server.url + "/metrics").text
    families = list(text_string_to_metric_families(text))
    assert families and all(f.name.startswith("mashbox:") for f in families)
    names = {f.name.removeprefix("mashbox:") for f in families}
    assert {*COUNTERS, *GAUGES, *HISTOGRAMS, "cache_config_info", "compiles_after_ready"} <= names
    for family in families:
        for sample in family.samples:
            assert sample.labels["model_name"] == MODEL, sample
    samples = parse(text)
    layout = {"block_size": "1024", "num_blocks": "4", "enable_prefix_caching": "True"}
    assert value(samples, "cache_config_info", **layout) == 1
    assert value(samples, "compiles_after_ready") == 0
    assert value(samples, "num_preemptions_total") == 0
    assert value(samples, "worker_restarts_total") == 0
    bounds = [
        float(dict(labels)["le"])
        for (name, labels) in samples
        if name == "mashbox:time_to_first_token_seconds_bucket"
    ]
    assert bounds[:3] == [0.001, 0.005, 0.01] and bounds[-2:] == [2560.0, float("inf")]


def test_counters_and_histograms_move_by_the_requests(server):
    before = wait_idle(server.url)
    usages = []
    body = {
        "prompt": "The capital of France is",
        "max_tokens": 3,
        "ignore_eos": True,
        "prompt_cache_key": "secret-key",
    }
    for _ in range(2):  # one after the other: the second finds the first's prompt cached
        r = httpx.post(
            server.url + "/v1/completions",
            json=body,
            headers={"X-Session-Id": "secret-session"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        usages.append({**r.json()["usage"], "cached": r.json()["timings"]["cache_n"]})
    after = wait_idle(server.url)

    def moved(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    prompt = sum(u["prompt_tokens"] for u in usages)
    cached = sum(u["cached"] for u in usages)
    assert usages[1]["cached"] > 0
    assert moved("generation_tokens_total") == 6
    assert moved("forward_passes_total") == 6  # each: one prefill chunk, two decodes
    assert moved("prompt_tokens_total") == prompt
    assert moved("prefix_cache_queries_total") == prompt
    assert moved("prefix_cache_hits_total") == cached
    assert moved("request_success_total", finished_reason="length") == 2
    assert moved("request_success_total", finished_reason="stop") == 0
    assert moved("num_preemptions_total") == 0
    assert moved("worker_restarts_total") == 0
    for histogram in HISTOGRAMS:
        assert moved(f"{histogram}_count") == 2
        assert moved(f"{histogram}_bucket", le="+Inf") == 2
        assert moved(f"{histogram}_sum") > 0 or histogram == "request_queue_time_seconds"
    # No label names a user, key or session.
    values = {v for _, labels in after for _, v in labels}
    assert not any("secret" in v for v in values), values


def test_a_stop_is_counted_as_stop(server):
    before = wait_idle(server.url)
    # The tiny model's text is random, but a one-character stop string still ends most
    # answers; whichever way it ends is the reason counted.
    r = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "a b c", "max_tokens": 40, "stop": [" "], "ignore_eos": True},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    reason = r.json()["choices"][0]["finish_reason"]
    after = wait_idle(server.url)
    other = {"stop": "length", "length": "stop"}[reason]
    assert value(after, "request_success_total", finished_reason=reason) == (
        value(before, "request_success_total", finished_reason=reason) + 1
    )
    assert value(after, "request_success_total", finished_reason=other) == (
        value(before, "request_success_total", finished_reason=other)
    )
    generated = r.json()["usage"]["completion_tokens"]
    assert value(after, "generation_tokens_total") - value(before, "generation_tokens_total") == (
        generated
    )


async def test_gauges_show_running_and_waiting(server):
    """Six streams that nobody reads hold the four slots; two wait for one."""
    wait_idle(server.url)
    body = {"prompt": "Once upon a time", "stream": True, "ignore_eos": True}
    seen = []
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:

        async def hold(done: trio.Event):
            async with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                await done.wait()  # never read: the request stays in its slot

        done = trio.Event()
        async with trio.open_nursery() as nursery:
            for _ in range(6):
                nursery.start_soon(hold, done)
            with trio.fail_after(30):
                while True:
                    samples = parse((await client.get("/metrics")).text)
                    health = (await client.get("/health")).json()
                    running = value(samples, "num_requests_running")
                    waiting = value(samples, "num_requests_waiting")
                    usage = value(samples, "kv_cache_usage_perc")
                    seen.append((running, waiting, usage))
                    if (running, waiting) == (4, 2) == (health["live_rows"], health["waiting"]):
                        break
                    await trio.sleep(0.02)
            done.set()
    running, waiting, usage = seen[-1]
    assert 0 < usage <= 1
    samples = wait_idle(server.url)
    assert value(samples, "kv_cache_usage_perc") == 0


async def test_metrics_answer_while_loading():
    """Before the model is loaded there is no scheduler: the gauges say 0, no layout yet."""
    state = ServerState(model_id=MODEL, ctx=0, slots=4)
    client = create_app(state).test_client()
    r = await client.get("/metrics")
    assert r.status_code == 200
    samples = parse((await r.get_data()).decode())
    assert value(samples, "num_requests_running") == 0
    assert value(samples, "generation_tokens_total") == 0
    assert not any(name == "mashbox:cache_config_info" for name, _ in samples)
    r = await client.get("/health")
    assert r.status_code == 503
    health = await r.get_json()
    assert health["status"] == "loading" and health["compiles_after_ready"] is None
    assert health["cache_namespace"] is None


def test_health_reports_every_field(server):
    health = httpx.get(server.url + "/v1/health").json()
    for field in ("cache_namespace", "deployment_id", "component_set_sha"):
        assert len(health[field]) == 64 and int(health[field], 16) >= 0, field
    assert len({health["cache_namespace"], health["deployment_id"]}) == 2
    assert health["certification"] == "not_certified"
    assert health["compiles_after_ready"] == 0
    assert health["routed_experts"] is None
    assert isinstance(health["worker_pid"], int) and health["worker_restarts"] == 0
    assert health["host_cache_cap_bytes"] == DEFAULT_CACHE_RAM_MIB * 2**20  # on unless asked
    assert health["snapshot_bytes"] == 0
    assert health["cache_bytes"] == health["host_cache_bytes"] <= health["host_cache_cap_bytes"]
    assert health["host_cache_evictions"] == 0
    assert health["live_rows"] >= 0 and health["waiting"] >= 0


def test_cache_namespace_covers_model_weights_tokenizer_template_and_policy():
    class Tok:
        def __init__(self, fingerprint):
            self.fingerprint = lambda: fingerprint

    class Template:
        def __init__(self, source):
            self.source = source

    def info(ctx=1024, device="cpu", decode_weights="float", kernels="", kv_dtype="float32"):
        return EngineInfo(
            arch="llama", n_params=1, weight_bytes=1, bits_per_weight=8.0, device=device,
            dtype="float32", n_layers=2, vocab_size=10, max_context=2048, ctx=ctx,
            decode_weights=decode_weights, kernels=kernels, kv_dtype=kv_dtype,
        )  # fmt: skip

    def ids(model="m", weights="w", tok="t", template="{{x}}", **engine):
        return model_identity(model, weights, Tok(tok), Template(template), info(**engine), 4)

    base = ids()
    assert ids() == base  # a pure function of its inputs
    for changed in (ids(model="n"), ids(weights="v"), ids(tok="u"), ids(template="{{y}}")):
        assert changed.cache_namespace != base.cache_namespace
    assert ids(ctx=512).cache_namespace != base.cache_namespace  # the cache policy
    assert ids(kv_dtype="float16").cache_namespace != base.cache_namespace
    # Another device runs other programs over the same model and the same cached prompts.
    other_device = ids(device="cuda:0")
    assert other_device.deployment_id != base.deployment_id
    assert other_device.component_set_sha == base.component_set_sha
    assert ids(model="n").component_set_sha == base.component_set_sha
    # A seeded answer repeats under the model's parts and what computes its steps: not the
    # name it is served under, nor the context; another decode kind, kernel target or KV
    # dtype differs.
    assert ids(model="n").answers == ids(ctx=512).answers == base.answers
    for changed in (
        ids(weights="v"),
        ids(decode_weights="int4"),
        ids(kernels="avx2 (x86-64-v3)"),
        ids(kv_dtype="float16"),
    ):
        assert changed.answers != base.answers
    assert ids(kv_dtype="float16").deployment_id != base.deployment_id
    assert base.system_fingerprint(7) == f"seed-7-fp_{base.answers}" and len(base.answers) == 12


def test_weights_sha_is_the_registry_one_or_a_stat_hash(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x")
    assert weights_sha(f, {"sha256": "ab" * 32}) == "ab" * 32
    first = weights_sha(f, None)
    f.write_bytes(b"xy")
    assert weights_sha(f, None) != first


async def test_nothing_compiles_after_ready_at_any_batch_size(server):
    """Decode batches of 1 to 4 rows (requests of different lengths, started together and
    one by one) run on kernels built before ready: compiles_after_ready stays 0 (it counts
    every kernel build or load and torch.compile graph in the worker after ready)."""
    from mashbox.engine import cpu_kernels

    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    # auto on a CPU: the file's own blocks; this one's matrices are Q8_0 (its norms F32).
    assert card["decode_weights"] == ("q8_0" if cpu_kernels.load() else "float")
    assert card["kv_dtype"] == ("float16" if cpu_kernels.load() else "float32")

    async def complete(client: httpx.AsyncClient, tokens: int) -> None:
        body = {"prompt": f"Count {tokens}", "max_tokens": tokens, "ignore_eos": True}
        r = await client.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.json()["usage"]["completion_tokens"] == tokens

    async with httpx.AsyncClient() as client:
        for group in ([5], [3, 9], [2, 6, 10, 14], [12, 1, 7]):
            async with trio.open_nursery() as nursery:
                for tokens in group:
                    nursery.start_soon(complete, client, tokens)
    assert value(wait_idle(server.url), "compiles_after_ready") == 0
    assert httpx.get(server.url + "/health").json()["compiles_after_ready"] == 0


# --- --vllm-metrics: the load gauges under vLLM's names, for llm-d's endpoint picker ------------


def vllm(samples: dict, name: str, **labels) -> float:
    return samples[(f"vllm:{name}", tuple(sorted({"model_name": MODEL, **labels}.items())))]


async def test_vllm_gauges_follow_the_mashbox_ones(tiny_llama):
    """Three unread streams on two slots: running 2, waiting 1, under both names, and the
    layout as vLLM's cache_config_info (a block: one slot of one whole context)."""
    with serving(str(tiny_llama), "--ctx", "512", "--slots", "2", "--threads", "1",
                 "--vllm-metrics", env={"MASHBOX_FAULTS": "slow=0.02"}) as proc:  # fmt: skip
        samples = wait_idle(proc.url)
        layout = {"block_size": "512", "num_gpu_blocks": "2", "num_cpu_blocks": "0"}
        assert vllm(samples, "cache_config_info", enable_prefix_caching="True", **layout) == 1
        assert vllm(samples, "kv_cache_usage_perc") == 0
        body = {"prompt": "Once upon a time", "stream": True, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=proc.url, timeout=60) as client:

            async def hold(done: trio.Event):
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    await done.wait()

            done = trio.Event()
            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(hold, done)
                with trio.fail_after(30):
                    while True:
                        samples = parse((await client.get("/metrics")).text)
                        theirs = [vllm(samples, n) for n in ("num_requests_running",
                                                             "num_requests_waiting")]  # fmt: skip
                        ours = [value(samples, n) for n in ("num_requests_running",
                                                            "num_requests_waiting")]  # fmt: skip
                        usage = vllm(samples, "kv_cache_usage_perc")
                        # Running counts admitted rows; usage, their filled KV: wait for both.
                        if theirs == ours == [2, 1] and usage > 0:
                            break
                        await trio.sleep(0.02)
                assert usage == value(samples, "kv_cache_usage_perc")
                assert 0 < usage <= 1
                done.set()
        samples = wait_idle(proc.url)
        assert vllm(samples, "num_requests_running") == vllm(samples, "kv_cache_usage_perc") == 0


async def test_vllm_gauges_only_when_asked_and_zero_while_loading():
    state = ServerState(model_id=MODEL, ctx=0, slots=4)
    client = create_app(state).test_client()
    text = (await (await client.get("/metrics")).get_data()).decode()
    assert "vllm:" not in text
    state.metrics.export_vllm_names()
    samples = parse((await (await client.get("/metrics")).get_data()).decode())
    assert vllm(samples, "num_requests_waiting") == vllm(samples, "num_requests_running") == 0
    assert vllm(samples, "kv_cache_usage_perc") == 0
    assert not any(name == "vllm:cache_config_info" for name, _ in samples)
