"""Admission control for the generation endpoints: at most `limit` requests admitted at once.

A request is admitted when it arrives (before its body is read) and counts until its response has been sent in
full (or its client went away): while it waits for the tokenizer, in the engine's queue and while it runs. So
`limit` bounds running + queued requests (`--max-concurrent-requests`, LMDeploy's flag). Refusals, sent before
the body is read:
- 429 `rate_limit_exceeded` with `Retry-After` when `limit` requests are in;
- 503 `server_shutting_down` while the server drains (`Admission.draining`);
- 503 `engine_dead` / `engine_hung` while the watchdog says the engine cannot serve.
The counter lives on the event loop (middleware only), so it needs no lock.

Metrics (in the app's registry): `lmdeploy:num_requests_admitted` (gauge) and
`lmdeploy:request_queue_time_seconds` (histogram: arrival to the start of the engine step that produced the
request's first output; for a prompt prefilled in one step that is the time until the engine took it up, for a
chunked prefill it also holds the earlier chunks).
"""
from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge, Histogram

from ..watchdog import Liveness
from .errors import APIError
from .metrics import ServerMetrics

GENERATION_PATHS = ('/v1/chat/completions', '/v1/completions')
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class Admission:

    def __init__(self, limit: int, liveness: Callable[[], Liveness], registry: CollectorRegistry,
                 retry_after: int = 1):
        self.limit = limit
        self.liveness = liveness
        self.retry_after = retry_after
        self.in_flight = 0
        self.draining = False
        Gauge('lmdeploy:num_requests_admitted', 'Requests admitted (tokenizing, queued or running)',
              registry=registry).set_function(lambda: self.in_flight)
        self.queue_time = Histogram('lmdeploy:request_queue_time_seconds',
                                    'Arrival to the start of the engine step that produced the first output',
                                    buckets=QUEUE_BUCKETS, registry=registry)

    def refusal(self) -> APIError | None:
        if self.draining:
            return APIError(503, 'the server is shutting down; retry on another replica', code='server_shutting_down',
                            type='service_unavailable')
        state = self.liveness()
        if state is not Liveness.OK:
            return APIError(503, f'the engine cannot serve now ({state.value}); see /health', code=state.value,
                            type='service_unavailable')
        if self.in_flight >= self.limit:
            return APIError(429, f'the server has {self.in_flight} requests in flight, its limit '
                            '(--max-concurrent-requests); retry later', code='rate_limit_exceeded',
                            type='rate_limit_error', headers={'Retry-After': str(self.retry_after)})
        return None

    def observe_queue_time(self, arrival: float, step_started: float) -> None:
        """`arrival`: `time.perf_counter()`; `step_started`: `time.monotonic()` (the engine loop's clock)."""
        started = time.perf_counter() - (time.monotonic() - step_started)
        self.queue_time.observe(max(started - arrival, 0.0))


class AdmissionMiddleware:

    def __init__(self, app, admission: Admission, metrics: ServerMetrics):
        self.app = app
        self.admission = admission
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope['type'] != 'http' or scope['method'] != 'POST' or scope['path'] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        error = self.admission.refusal()
        if error is not None:
            self.metrics.reject(error.status)
            await error.response()(scope, receive, send)
            return
        self.admission.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.in_flight -= 1
