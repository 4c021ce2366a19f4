"""Prometheus metrics of one API server app, in a private `CollectorRegistry` (two apps never share counters).

Two sources:
- request metrics (counts by finish reason, token counts, TTFT, latency) are recorded by the server as responses
  stream out, through one `RequestTracker` per request;
- engine metrics (queue lengths, pool usage, prefix-cache counters) come from the engine's per-step statistics
  record (`Engine.stats_snapshot`, frozen), read at scrape time by `EngineCollector`.
"""
from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ...messages import Response

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class EngineCollector:
    """Scrape-time view of the engine's queues, pools and prefix-cache counters: `engine.stats_snapshot`, the frozen
    record the engine publishes once per step (the scheduler is never read from this thread)."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats_snapshot
        yield _gauge('lmdeploy_num_requests_running', 'Requests in the running batch', stats.num_running)
        yield _gauge('lmdeploy_num_requests_waiting', 'Requests waiting to be scheduled', stats.num_waiting)
        yield _gauge('lmdeploy_kv_cache_blocks_total', 'KV blocks in the pool', stats.num_kv_blocks)
        yield _gauge('lmdeploy_kv_cache_blocks_free', 'KV blocks on the free list', stats.num_free_kv_blocks)
        yield _gauge('lmdeploy_kv_cache_usage_ratio', 'Fraction of KV blocks not on the free list', stats.kv_usage)
        yield _gauge('lmdeploy_state_cache_usage_ratio', 'Fraction of recurrent-state slots in use (hybrid models)',
                     stats.state_usage)
        yield from _vision_cache_metrics(stats.vision_cache)
        cache = stats.prefix_cache
        yield CounterMetricFamily('lmdeploy_prefix_cache_query_tokens', 'Prompt tokens looked up in the prefix cache',
                                  value=cache.query_tokens)
        yield CounterMetricFamily('lmdeploy_prefix_cache_hit_tokens', 'Prompt tokens served from the prefix cache',
                                  value=cache.hit_tokens)
        yield _gauge('lmdeploy_prefix_cache_hit_rate', 'hit_tokens / query_tokens since start', cache.hit_rate)
        misses = CounterMetricFamily('lmdeploy_prefix_cache_misses', 'Prefix-cache misses by reason',
                                     labels=['reason'])
        for reason, count in sorted(cache.miss_reasons.items()):
            misses.add_metric([str(reason)], count)
        yield misses


def _vision_cache_metrics(cache) -> Iterator[Metric]:
    if cache is None:
        return  # no vision tower, or its encoder cache is off
    yield CounterMetricFamily('lmdeploy_vision_cache_hits', 'Images whose embeddings came from the encoder cache',
                              value=cache.hits)
    yield CounterMetricFamily('lmdeploy_vision_cache_misses', 'Images run through the vision tower',
                              value=cache.misses)
    yield _gauge('lmdeploy_vision_cache_entries', 'Encoded images held by the encoder cache', cache.entries)
    yield _gauge('lmdeploy_vision_cache_bytes', 'Device bytes held by the encoder cache', cache.bytes)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


class ServerMetrics:

    def __init__(self, engine):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter('lmdeploy_requests', 'Finished requests by endpoint and finish reason',
                                ['endpoint', 'finish_reason'], registry=registry)
        self.rejected = Counter('lmdeploy_rejected_requests', 'Requests answered with an error status',
                                ['status'], registry=registry)
        self.prompt_tokens = Counter('lmdeploy_prompt_tokens', 'Prompt tokens of finished requests',
                                     registry=registry)
        self.generation_tokens = Counter('lmdeploy_generation_tokens', 'Generated tokens of finished requests',
                                         registry=registry)
        self.cached_tokens = Counter('lmdeploy_cached_prompt_tokens',
                                     'Prompt tokens of finished requests served from the prefix cache',
                                     registry=registry)
        self.ttft = Histogram('lmdeploy_time_to_first_token_seconds', 'Request arrival to first generated token',
                              buckets=TTFT_BUCKETS, registry=registry)
        self.latency = Histogram('lmdeploy_e2e_request_latency_seconds', 'Request arrival to last token',
                                 buckets=LATENCY_BUCKETS, registry=registry)
        registry.register(EngineCollector(engine))

    def track(self, endpoint: str, arrival: float) -> RequestTracker:
        return RequestTracker(self, endpoint, arrival)

    def reject(self, status: int) -> None:
        self.rejected.labels(status=str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTracker:
    """Feeds one request's responses into `ServerMetrics`; `close()` records the outcome exactly once."""

    __slots__ = ('metrics', 'endpoint', 'arrival', 'has_first_token', 'last')

    def __init__(self, metrics: ServerMetrics, endpoint: str, arrival: float):
        self.metrics = metrics
        self.endpoint = endpoint
        self.arrival = arrival  # time.perf_counter() when the request arrived
        self.has_first_token = False
        self.last: Response | None = None

    def observe(self, response: Response) -> None:
        if not self.has_first_token and response.generate_token_len > 0:
            self.has_first_token = True
            self.metrics.ttft.observe(time.perf_counter() - self.arrival)
        self.last = response

    def close(self) -> None:
        """A request that ends without a finish reason was cut off (client disconnect): 'abort'."""
        m, last = self.metrics, self.last
        reason = last.finish_reason if last is not None and last.finish_reason else 'abort'
        m.requests.labels(endpoint=self.endpoint, finish_reason=reason).inc()
        m.latency.observe(time.perf_counter() - self.arrival)
        if last is not None:
            m.prompt_tokens.inc(last.input_token_len)
            m.generation_tokens.inc(last.generate_token_len)
            m.cached_tokens.inc(last.cached_tokens)
