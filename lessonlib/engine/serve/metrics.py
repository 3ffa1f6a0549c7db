"""/metrics in Prometheus' text format (prometheus_client), vLLM's metric names under the ``lessonlib:`` prefix.

Gauges are read from the engine when scraped (requests running and waiting, KV blocks used and in all, requests
aborted); the
latencies are observed per request as the server sends its tokens: time to first token (from the request's arrival)
and inter-token latency (the gap between a stream's consecutive outputs, one per engine step that gave it tokens).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from lessonlib.engine.async_llm import AsyncLLM

# Buckets in seconds: a GPU answers in milliseconds, the CPU interpreter in seconds; both land inside.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.2, 0.4, 0.8, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    def __init__(self, engine: AsyncLLM, model_name: str):
        self.registry = registry = CollectorRegistry()  # the app's own: two apps in one process do not collide
        labels = {"model_name": model_name}
        blocks = engine.llm.block_manager
        for name, doc, read in (
                ("num_requests_running", "Requests in the running batch", lambda: engine.num_running),
                ("num_requests_waiting", "Requests waiting to be admitted", lambda: engine.num_waiting),
                ("kv_blocks_used", "KV-cache blocks held by requests", lambda: blocks.num_used),
                ("kv_blocks_total", "KV-cache blocks in the pool", lambda: blocks.num_blocks)):
            Gauge(f"lessonlib:{name}", doc, list(labels), registry=registry).labels(**labels).set_function(read)
        self.ttft = Histogram("lessonlib:time_to_first_token_seconds", "Time to first token", list(labels),
                              buckets=TTFT_BUCKETS, registry=registry).labels(**labels)
        self.itl = Histogram("lessonlib:inter_token_latency_seconds", "Inter-token latency", list(labels),
                             buckets=ITL_BUCKETS, registry=registry).labels(**labels)
        self.generated = Counter("lessonlib:generation_tokens", "Generated tokens", list(labels),
                                 registry=registry).labels(**labels)
        self.prompt = Counter("lessonlib:prompt_tokens", "Prompt tokens", list(labels),
                              registry=registry).labels(**labels)
        self.finished = Counter("lessonlib:request_success", "Requests finished, by reason",
                                [*labels, "finished_reason"], registry=registry)
        self.labels = labels
        registry.register(_Aborted(engine, labels))

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

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _Aborted:
    """Requests the engine stopped before they finished, read from the engine when scraped (a client that went away
    counts only once its request has really left the engine)."""

    def __init__(self, engine: AsyncLLM, labels: dict):
        self.engine, self.labels = engine, labels

    def collect(self):
        family = CounterMetricFamily("lessonlib:num_requests_aborted", "Requests aborted before they finished",
                                     labels=list(self.labels))
        family.add_metric(list(self.labels.values()), self.engine.num_aborted)
        yield family
