"""/metrics in Prometheus' text format (prometheus_client), named as vLLM's v1 engine names them (``vllm:``), so a
vLLM dashboard reads this server; two series of the course's own (``lessonlib:kv_blocks_used``, ``_total``: the
lesson's block counts, which vLLM gives only as a share).

Read from the engine when scraped: requests running and waiting (requests, not their ``n`` sequences), the KV cache's
use, preemptions. Observed per request as the server answers it: time to first token (from the request's arrival,
before its tokenization), inter-token latency (the gap between a stream's consecutive outputs, one per engine step
that gave it tokens), time per output token, end-to-end latency, queue time (from the engine's queue to its first
step), prompt and generated tokens, prefix-cache queries and hits (prompt tokens), and each request's end by
``finished_reason`` (``stop``, ``length``, ``abort``: every abort, whatever its cause, counted once).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from lessonlib.engine.async_llm import AsyncLLM

# Buckets in seconds: a GPU answers in milliseconds, the CPU interpreter in seconds; both land inside.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.2, 0.4, 0.8, 1.0, 2.5, 5.0, 10.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


class Metrics:
    def __init__(self, engine: AsyncLLM, model_name: str):
        self.registry = registry = CollectorRegistry()  # the app's own: two apps in one process do not collide
        self.labels = labels = {"model_name": model_name}
        names = list(labels)
        blocks = engine.llm.block_manager
        for name, doc, read in (
                ("vllm:num_requests_running", "Requests in the running batch", lambda: engine.num_running),
                ("vllm:num_requests_waiting", "Requests waiting to be admitted", lambda: engine.num_waiting),
                ("vllm:kv_cache_usage_perc", "KV-cache usage (1 = every block held)",
                 lambda: blocks.num_used / blocks.num_blocks),
                ("lessonlib:kv_blocks_used", "KV-cache blocks held by requests", lambda: blocks.num_used),
                ("lessonlib:kv_blocks_total", "KV-cache blocks in the pool", lambda: blocks.num_blocks)):
            Gauge(name, doc, names, registry=registry).labels(**labels).set_function(read)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, names, buckets=buckets, registry=registry).labels(**labels)

        def counter(name, doc):
            return Counter(name, doc, names, registry=registry).labels(**labels)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Inter-token latency", ITL_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds", "Time per output token per request",
                              ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", REQUEST_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds", "Time in the waiting queue", REQUEST_BUCKETS)
        self.generated = counter("vllm:generation_tokens", "Generated tokens")
        self.prompt = counter("vllm:prompt_tokens", "Prompt tokens")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.finished = Counter("vllm:request_success", "Requests ended, by reason (abort included)",
                                [*names, "finished_reason"], registry=registry)
        registry.register(_Preemptions(engine, labels))

    def tokens(self, arrived: float, last: float | None, now: float, count: int) -> None:
        """``count`` new tokens of one request sent at ``now``; ``last``: when its previous tokens were sent (None:
        these are its first)."""
        if count <= 0:
            return
        self.generated.inc(count)
        if last is None:
            self.ttft.observe(now - arrived)
        else:
            self.itl.observe(now - last)

    def request(self, reason: str, e2e: float, first: float | None, tokens: int, queue_s: float | None,
                prompt_tokens: int, cached_tokens: int) -> None:
        """One request's end: its reason, latency, time per output token (after the first), queue time, and its
        prompt's prefix-cache lookup (counted once it reached the engine)."""
        self.finished.labels(**self.labels, finished_reason=reason).inc()
        self.e2e.observe(e2e)
        if first is not None and tokens > 1:
            self.tpot.observe((e2e - first) / (tokens - 1))
        if queue_s is not None:
            self.queue.observe(queue_s)
            self.prefix_queries.inc(prompt_tokens)
            self.prefix_hits.inc(cached_tokens)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _Preemptions:
    """The scheduler's preemptions so far, read when scraped."""

    def __init__(self, engine: AsyncLLM, labels: dict):
        self.engine, self.labels = engine, labels

    def collect(self):
        family = CounterMetricFamily("vllm:num_preemptions", "Preemptions (a request's blocks freed to recompute)",
                                     labels=list(self.labels))
        family.add_metric(list(self.labels.values()), self.engine.llm.scheduler.num_preemptions)
        yield family
