"""/metrics: what the server does, in the Prometheus text format, under vLLM's metric names.

Every name starts with `mashbox:` (with `--vllm-metrics` the load gauges are also exported
under `vllm:`, for pickers that read vLLM's); the one label every metric has is
`model_name`, the served model id. No label names a user, an API key or a session. Counters
and histograms are fed by the scheduler through the `Observer` calls; gauges are read from one
snapshot of the server (`ServerState.statistics`) at each scrape, so they answer while the
model loads too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from ..events import Finished
from ..observer import Observer

if TYPE_CHECKING:  # (state.py builds the Metrics: a type only here, never an import)
    from .state import ServerStatistics

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

# vLLM's bucket edges (vllm/v1/metrics/loggers.py), so dashboards built for it fit as they are.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TPOT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

# The scheduler's reasons. An answer that ends in tool calls ends with "stop" there (the route
# reads the calls out of the text afterwards), so it is counted as "stop".
FINISH_REASONS = ("stop", "length", "tool_calls")


class Metrics(Observer):
    """The server's registry (never prometheus-client's global one) and the scheduler's
    observer that feeds it."""

    def __init__(self, model: str, read: Callable[[], ServerStatistics]):
        """model: the served id (every metric's label); read: the server's snapshot, now."""
        self.registry = CollectorRegistry()

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["model_name"], registry=self.registry).labels(model)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            metric = Histogram(name, doc, ["model_name"], registry=self.registry, buckets=buckets)
            return metric.labels(model)

        success = Counter(
            "mashbox:request_success",
            "Requests answered, by finish reason: stop (end of turn or a stop string), length, "
            "tool_calls (the answer called tools).",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.request_success = {reason: success.labels(model, reason) for reason in FINISH_REASONS}
        self.prompt_tokens = counter(
            "mashbox:prompt_tokens", "Prompt tokens of requests prefilled (cached ones included)."
        )
        self.generation_tokens = counter("mashbox:generation_tokens", "Tokens generated.")
        self.engine_steps = counter("mashbox:engine_steps", "Engine steps run.")
        self.engine_seconds = counter(
            "mashbox:engine_busy_seconds",
            "Seconds the engine spent inside steps (the rest of the wall time is the server's).",
        )
        self.forward_passes = counter(
            "mashbox:forward_passes",
            "Model forward passes run: prefill chunks, decode batches, decision reads.",
        )
        self.prefix_cache_queries = counter(
            "mashbox:prefix_cache_queries",
            "Prefix cache lookups, in tokens: the prompt tokens of each request given a slot.",
        )
        self.prefix_cache_hits = counter(
            "mashbox:prefix_cache_hits",
            "Prefix cache hits, in tokens: prompt tokens whose KV a slot already held.",
        )
        self.num_preemptions = counter(
            "mashbox:num_preemptions",
            "Requests preempted (never: a request keeps its slot until it ends).",
        )
        self.ttft = histogram(
            "mashbox:time_to_first_token_seconds",
            "Time from submission to the first generated token.",
            TTFT_BUCKETS,
        )
        self.queue_time = histogram(
            "mashbox:request_queue_time_seconds",
            "Time a request waited for a slot.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "mashbox:e2e_request_latency_seconds",
            "Time from submission to the last token.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.tpot = histogram(
            "mashbox:time_per_output_token_seconds",
            "Mean time per generated token after the first (requests with two or more).",
            TPOT_BUCKETS,
        )
        self.model, self.read = model, read
        self.registry.register(_LiveCollector(model, read))

    def export_vllm_names(self) -> None:
        """Also export the load gauges under vLLM's own names (`--vllm-metrics`), which
        llm-d's endpoint picker and other vLLM-made scorers read."""
        self.registry.register(_VllmGauges(self.model, self.read))

    # --- the scheduler's observer ---------------------------------------------------------

    def admitted(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prefix_cache_queries.inc(prompt_tokens)
        self.prefix_cache_hits.inc(cached_tokens)

    def stepped(
        self, prompt_tokens: int, generated_tokens: int, forwards: int = 0, engine_s: float = 0.0
    ) -> None:
        self.engine_steps.inc()
        self.engine_seconds.inc(engine_s)
        self.forward_passes.inc(forwards)
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
        if generated_tokens:
            self.generation_tokens.inc(generated_tokens)

    def succeeded(self, reason: str) -> None:
        self.request_success[reason].inc()

    def finished(
        self, done: Finished, *, queue_s: float, ttft_s: float, e2e_s: float, tpot_s: float | None
    ) -> None:
        # Histograms count finished requests only; cancelled and failed ones are in neither.
        self.queue_time.observe(queue_s)
        self.ttft.observe(ttft_s)
        self.e2e.observe(e2e_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)

    def render(self) -> bytes:
        """The text exposition of every metric, as of now."""
        return generate_latest(self.registry)


# The load a router or endpoint picker scores a replica by: (name, help, value of the
# scheduler's Stats); 0 before the model is loaded.
_LOAD = (
    ("num_requests_running", "Requests holding a slot.", lambda s: s.running),
    ("num_requests_waiting", "Requests waiting for a slot.", lambda s: s.waiting),
    (
        "kv_cache_usage_perc",
        "Fraction of the KV cache (slots x context) holding tokens of running requests.",
        lambda s: s.kv_cache_usage,
    ),
)


def _gauge(name: str, doc: str, model: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["model_name"])
    family.add_metric([model], value)
    return family


def _load_gauges(prefix: str, model: str, stats, also: str | None = None):
    """The load gauges under `prefix`; `also`: the prefix their help names as the same."""
    for name, doc, read in _LOAD:
        if also:
            doc = f"{doc} ({also}:{name})"
        yield _gauge(f"{prefix}:{name}", doc, model, read(stats) if stats else 0)


class _LiveCollector:
    """Gauges (and the restart counter) read from one snapshot of the server at each scrape."""

    def __init__(self, model: str, read: Callable[[], ServerStatistics]):
        self.model, self.read = model, read

    def collect(self):
        snap = self.read()
        model = [self.model]
        stats, engine = snap.scheduler, snap.engine
        info = engine.info if engine else None

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return _gauge(name, doc, self.model, value)

        yield from _load_gauges("mashbox", self.model, stats)
        if stats is not None and info is not None:  # the layout is final once the model runs
            layout = GaugeMetricFamily(
                "mashbox:cache_config_info",
                "The KV cache layout: one slot (block) holds one whole context.",
                labels=["model_name", "block_size", "num_blocks", "enable_prefix_caching"],
            )
            layout.add_metric([self.model, str(info.ctx), str(stats.slots), "True"], 1)
            yield layout
        if info is not None:
            decode = GaugeMetricFamily(
                "mashbox:decode_info",
                "What a decode step runs: weights, CPU kernels and their compiler target.",
                labels=["model_name", "decode"],
            )
            decode.add_metric([self.model, info.decode], 1)
            yield decode
            yield gauge(
                "mashbox:cpu_kernels_fallback",
                "1 when decode fell back to torch's ops because mashbox's CPU kernels did not "
                "load (the log and /health say why).",
                1 if info.kernels_fallback else 0,
            )
        restarts = CounterMetricFamily(
            "mashbox:worker_restarts",
            "Times the engine worker process was started again after a fault.",
            labels=["model_name"],
        )
        restarts.add_metric(model, engine.restarts if engine else 0)
        yield restarts
        yield gauge(
            "mashbox:compiles_after_ready",
            "Programs compiled since the server reported ready, in every worker process.",
            engine.compiles_after_ready if engine else 0,
        )


class _VllmGauges:
    """The gauges a vLLM-reading picker scores a pod by, under vLLM's names and labels. vLLM's
    KV cache is paged; mashbox's slot holds one whole context, so cache_config_info says
    block_size = the context, num_gpu_blocks = the slots (whatever device they live on) and
    num_cpu_blocks = 0 (the host prompt cache holds copies of prefixes, not blocks)."""

    def __init__(self, model: str, read: Callable[[], ServerStatistics]):
        self.model, self.read = model, read

    def collect(self):
        snap = self.read()
        stats, engine = snap.scheduler, snap.engine
        info = engine.info if engine else None

        yield from _load_gauges("vllm", self.model, stats, also="mashbox")
        if stats is not None and info is not None:
            layout = GaugeMetricFamily(
                "vllm:cache_config_info",
                "The KV cache layout: a block is one slot holding one whole context.",
                labels=[
                    "model_name",
                    "block_size",
                    "num_gpu_blocks",
                    "num_cpu_blocks",
                    "enable_prefix_caching",
                ],
            )
            layout.add_metric([self.model, str(info.ctx), str(stats.slots), "0", "True"], 1)
            yield layout
