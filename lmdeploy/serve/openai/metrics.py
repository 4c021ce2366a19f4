"""Prometheus metrics of one API server app, in a private `CollectorRegistry` (two apps never share counters).

Two sources:
- request metrics (counts by finish reason, token counts, TTFT, latency) are recorded by the server as responses
  stream out, through one `RequestTracker` per request;
- engine metrics (queue lengths, pool usage, prefix-cache counters, routed-experts memory, speculative decoding's
  acceptance) come from the engine's per-step statistics record (`Engine.stats_snapshot`, frozen), read at scrape
  time by `EngineCollector`.
"""
from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ...messages import Response

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class EngineCollector:
    """Scrape-time view of the engine's queues, pools and prefix-cache counters: `engine.stats_snapshot`, the frozen
    record the engine publishes once per step (the scheduler is never read from this thread)."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats_snapshot
        yield _gauge('lmdeploy:num_requests_running', 'Requests in the running batch', stats.num_running)
        yield _gauge('lmdeploy:num_requests_waiting', 'Requests waiting to be scheduled', stats.num_waiting)
        yield _gauge('lmdeploy:kv_cache_blocks_total', 'KV blocks in the pool', stats.num_kv_blocks)
        yield _gauge('lmdeploy:kv_cache_blocks_free', 'KV blocks on the free list', stats.num_free_kv_blocks)
        yield _gauge('lmdeploy:kv_cache_usage_ratio', 'Fraction of KV blocks not on the free list', stats.kv_usage)
        yield _gauge('lmdeploy:state_cache_usage_ratio', 'Fraction of recurrent-state slots in use (hybrid models)',
                     stats.state_usage)
        yield from _vision_cache_metrics(stats.vision_cache)
        yield from _routed_experts_metrics(stats)
        yield from _speculative_metrics(stats.speculative)
        cache = stats.prefix_cache
        yield CounterMetricFamily('lmdeploy:prefix_cache_query_tokens', 'Prompt tokens looked up in the prefix cache',
                                  value=cache.query_tokens)
        yield CounterMetricFamily('lmdeploy:prefix_cache_hit_tokens', 'Prompt tokens served from the prefix cache',
                                  value=cache.hit_tokens)
        yield _gauge('lmdeploy:prefix_cache_hit_rate', 'hit_tokens / query_tokens since start', cache.hit_rate)
        misses = CounterMetricFamily('lmdeploy:prefix_cache_misses', 'Prefix-cache misses by reason',
                                     labels=['reason'])
        for reason, count in sorted(cache.miss_reasons.items()):
            misses.add_metric([str(reason)], count)
        yield misses


def _speculative_metrics(spec) -> Iterator[Metric]:
    if spec is None:
        return  # speculative decoding is off
    yield CounterMetricFamily('lmdeploy:spec_decode_num_drafts', 'Decode steps that verified draft tokens',
                              value=spec.num_verify_rows)
    yield CounterMetricFamily('lmdeploy:spec_decode_num_draft_tokens', 'Draft tokens verified',
                              value=spec.num_draft_tokens)
    yield CounterMetricFamily('lmdeploy:spec_decode_num_accepted_tokens', 'Draft tokens accepted',
                              value=spec.num_accepted_tokens)
    yield _gauge('lmdeploy:spec_decode_acceptance_rate', 'accepted / verified draft tokens since start',
                 spec.acceptance_rate)
    yield _gauge('lmdeploy:spec_decode_mean_accepted_length',
                 'Tokens emitted per verifying decode step since start (1 + accepted drafts)',
                 spec.mean_accepted_length)


def _vision_cache_metrics(cache) -> Iterator[Metric]:
    if cache is None:
        return  # no vision tower, or its encoder cache is off
    yield CounterMetricFamily('lmdeploy:vision_cache_hits', 'Images whose embeddings came from the encoder cache',
                              value=cache.hits)
    yield CounterMetricFamily('lmdeploy:vision_cache_misses', 'Images run through the vision tower',
                              value=cache.misses)
    yield _gauge('lmdeploy:vision_cache_entries', 'Encoded images held by the encoder cache', cache.entries)
    yield _gauge('lmdeploy:vision_cache_bytes', 'Device bytes held by the encoder cache', cache.bytes)


def _routed_experts_metrics(stats) -> Iterator[Metric]:
    if stats.routed_experts_bytes_per_token is None:
        return  # routed experts off, or the prefix cache keeps none (caching off, or a dense model)
    yield _gauge('lmdeploy:routed_experts_bytes_per_token',
                 'Host bytes the prefix cache keeps per cached token for its routed experts',
                 stats.routed_experts_bytes_per_token)
    yield _gauge('lmdeploy:routed_experts_cache_bytes',
                 'Host bytes of the routed experts the prefix cache holds (blocks and checkpoint tails)',
                 stats.routed_experts_cached_bytes)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


class ServerMetrics:
    """Request metrics under LMDeploy's names (`lmdeploy:` prefix; `lmdeploy:time_per_output_token_seconds`,
    `lmdeploy:iter_token_latency`, `lmdeploy:request_prefill_time_seconds`, ... as its dashboards query them)."""

    def __init__(self, engine):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter('lmdeploy:requests', 'Finished requests by endpoint and finish reason',
                                ['endpoint', 'finish_reason'], registry=registry)
        self.rejected = Counter('lmdeploy:rejected_requests', 'Requests answered with an error status',
                                ['status'], registry=registry)
        self.prompt_tokens = Counter('lmdeploy:prompt_tokens', 'Prompt tokens of finished requests',
                                     registry=registry)
        self.generation_tokens = Counter('lmdeploy:generation_tokens', 'Generated tokens of finished requests',
                                         registry=registry)
        self.cached_tokens = Counter('lmdeploy:cached_prompt_tokens',
                                     'Prompt tokens of finished requests served from the prefix cache',
                                     registry=registry)
        self.ttft = Histogram('lmdeploy:time_to_first_token_seconds', 'Request arrival to first generated token',
                              buckets=TTFT_BUCKETS, registry=registry)
        self.tpot = Histogram('lmdeploy:time_per_output_token_seconds',
                              'Per request: (last token - first token) / (generated tokens - 1)',
                              buckets=TOKEN_BUCKETS, registry=registry)
        self.itl = Histogram('lmdeploy:iter_token_latency', 'Inter-token latency: time between consecutive tokens',
                             buckets=TOKEN_BUCKETS, registry=registry)
        self.prefill_time = Histogram('lmdeploy:request_prefill_time_seconds',
                                      'Start of the engine step that produced the first token to that token',
                                      buckets=LATENCY_BUCKETS, registry=registry)
        self.decode_time = Histogram('lmdeploy:request_decode_time_seconds', 'First token to last token',
                                     buckets=LATENCY_BUCKETS, registry=registry)
        self.inference_time = Histogram('lmdeploy:request_inference_time_seconds',
                                        'Start of the first engine step to the last token',
                                        buckets=LATENCY_BUCKETS, registry=registry)
        self.latency = Histogram('lmdeploy:e2e_request_latency_seconds', 'Request arrival to last token',
                                 buckets=LATENCY_BUCKETS, registry=registry)
        registry.register(EngineCollector(engine))

    def track(self, endpoint: str, arrival: float) -> RequestTracker:
        return RequestTracker(self, endpoint, arrival)

    def reject(self, status: int) -> None:
        self.rejected.labels(status=str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTracker:
    """Feeds one request's responses into `ServerMetrics`; `close()` records the outcome exactly once.

    Times are `time.perf_counter()`: `arrival`, `scheduled` (start of the engine step that produced the first
    output, from `on_first_step`), `first_token`, `last_token`.
    """

    __slots__ = ('metrics', 'endpoint', 'arrival', 'scheduled', 'first_token', 'last_token', 'last')

    def __init__(self, metrics: ServerMetrics, endpoint: str, arrival: float):
        self.metrics = metrics
        self.endpoint = endpoint
        self.arrival = arrival
        self.scheduled: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.last: Response | None = None

    def first_step(self, step_started_monotonic: float) -> None:
        self.scheduled = time.perf_counter() - (time.monotonic() - step_started_monotonic)

    def observe(self, response: Response) -> None:
        now = time.perf_counter()
        new_tokens = len(response.token_ids)
        if new_tokens and self.first_token is None:
            self.first_token = now
            self.metrics.ttft.observe(now - self.arrival)
        elif new_tokens:
            gap = (now - self.last_token) / new_tokens
            for _ in range(new_tokens):
                self.metrics.itl.observe(gap)
        if new_tokens:
            self.last_token = now
        self.last = response

    def close(self) -> None:
        """A request that ends without a finish reason was cut off (client disconnect): 'abort'."""
        m, last = self.metrics, self.last
        reason = last.finish_reason if last is not None and last.finish_reason else 'abort'
        m.requests.labels(endpoint=self.endpoint, finish_reason=reason).inc()
        m.latency.observe(time.perf_counter() - self.arrival)
        if last is None:
            return
        m.prompt_tokens.inc(last.input_token_len)
        m.generation_tokens.inc(last.generate_token_len)
        m.cached_tokens.inc(last.cached_tokens)
        if self.first_token is None:
            return
        m.decode_time.observe(self.last_token - self.first_token)
        if last.generate_token_len > 1:
            m.tpot.observe((self.last_token - self.first_token) / (last.generate_token_len - 1))
        if self.scheduled is not None:
            m.prefill_time.observe(max(self.first_token - self.scheduled, 0.0))
            m.inference_time.observe(max(self.last_token - self.scheduled, 0.0))
