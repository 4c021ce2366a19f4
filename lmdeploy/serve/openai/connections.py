"""Connection hygiene for uvicorn's h11 protocol: a header deadline and a cap on open connections.

uvicorn keeps a connection that never completes its request headers forever (its keep-alive timer only runs
between requests, and any byte received cancels it), so slow or half-open clients could hold every descriptor.
`guarded_protocol` returns an `H11Protocol` subclass that adds:
- a header deadline: `timeout_header` seconds from connect, and again from the end of each response, for the next
  request's headers to be complete; past it the connection is closed (no response: the client sent no request);
- a cap of `max_connections` open connections per server. When a new connection would pass it, the oldest
  connection that is not in the middle of a request (headers incomplete, or idle keep-alive) is closed to make
  room; if every connection is busy, the newcomer is closed. New clients therefore always get in, and slowloris
  clients are cycled out, oldest first.
`raise_descriptor_limit` first lifts the soft descriptor limit to the hard one (up to 65,536); `connection_cap`
then lowers the cap to fit the process's descriptor limit (less a reserve and the accept bursts in flight), so
accept() never runs out of descriptors, even under a flood of new connections (if it did, asyncio would pause
accepting for a second and the server would go on).
"""
from __future__ import annotations

import asyncio
import logging
import os
import resource
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger('lmdeploy')
_RESERVED_FDS = 64  # descriptors kept free for everything but client connections (files, pipes, the listener)
# asyncio accepts up to `backlog` connections per wake-up of the listener; each runs `connection_made` (where the
# cap is enforced) two loop iterations later (a task creates the transport, which schedules the call), and a
# connection evicted there keeps its descriptor one iteration more, while the listener keeps accepting bursts: up to
# about four bursts of descriptors are in flight beyond the cap. Reserving fewer let a flood of connections hit
# EMFILE (asyncio then stops accepting for a second, again and again while the flood lasts: normal requests stalled
# for 1 to over 15 s at a 1024-descriptor limit). The backlog (listen queue and burst size) scales with the limit:
# 64 at 1,024 descriptors (a cap of ~700), uvicorn's 2,048 from ~33,000 up.
_BURSTS_IN_FLIGHT = 4
_BACKLOG_MIN, _BACKLOG_MAX = 64, 2048


class ConnectionGuard:
    """The open connections of one server, oldest first (dicts keep insertion order)."""

    def __init__(self, max_connections: int):
        self.max_connections = max_connections
        self.open: dict[GuardedH11Protocol, None] = {}
        self.num_evicted = 0
        self.num_header_timeouts = 0

    def admit(self, conn: GuardedH11Protocol) -> bool:
        """Make room for `conn` if needed; False when it must be closed instead."""
        if len(self.open) >= self.max_connections:
            victim = next((c for c in self.open if c.is_between_requests), None)
            if victim is None:
                return False
            self.num_evicted += 1
            self.open.pop(victim)
            victim.close_now()
        self.open[conn] = None
        return True

    def discard(self, conn: GuardedH11Protocol) -> None:
        self.open.pop(conn, None)

    def collect(self) -> Iterator[Metric]:
        """Prometheus collector protocol (registered in the app's registry by `run_app`)."""
        yield GaugeMetricFamily('lmdeploy:http_connections', 'Open HTTP connections', value=len(self.open))
        yield GaugeMetricFamily('lmdeploy:http_connections_max', 'Connection cap (fitted to RLIMIT_NOFILE)',
                                value=self.max_connections)
        yield CounterMetricFamily('lmdeploy:http_connections_evicted', 'Connections closed to make room for new ones',
                                  value=self.num_evicted)
        yield CounterMetricFamily('lmdeploy:http_header_timeouts', 'Connections closed for sending no complete '
                                  'request headers within --timeout-header', value=self.num_header_timeouts)


class GuardedH11Protocol(H11Protocol):
    guard: ConnectionGuard
    timeout_header: float

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        if not self.guard.admit(self):
            logger.warning('connection cap (%d) reached with every connection busy: closing a new one',
                           self.guard.max_connections)
            self.close_now()
            return
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.discard(self)
        self._cancel_header_timer()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()

    @property
    def is_between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def close_now(self) -> None:
        self._cancel_header_timer()
        if not self.transport.is_closing():
            self.transport.close()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.timeout_header, self._header_timeout, self.cycle)

    def _cancel_header_timer(self) -> None:
        timer = getattr(self, '_header_timer', None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _header_timeout(self, cycle_when_armed) -> None:
        # No new request (cycle) started since the timer was armed: its headers did not arrive in time.
        if self.cycle is cycle_when_armed and self.is_between_requests:
            self.guard.num_header_timeouts += 1
            self.close_now()


def guarded_protocol(max_connections: int, timeout_header: float) -> type[GuardedH11Protocol]:
    """An `H11Protocol` class for `uvicorn.Config(http=...)`, with its own `ConnectionGuard`."""
    return type('GuardedH11Protocol', (GuardedH11Protocol,),
                {'guard': ConnectionGuard(max_connections), 'timeout_header': timeout_header})


def raise_descriptor_limit(target: int = 65536) -> int:
    """Raise RLIMIT_NOFILE's soft limit towards `target` (never past the hard limit), as serving engines do at
    start: a login shell's soft 1,024 would otherwise cap the server near 700 connections though the hard limit
    allows far more. Returns the soft limit in force (unchanged if raising fails)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            logger.info('descriptor limit raised from %d to %d (hard limit %s)', soft, want, hard)
            return want
        except (ValueError, OSError) as exc:
            logger.warning('could not raise the descriptor limit from %d: %s', soft, exc)
    return soft


def _descriptors_free() -> int | None:
    """RLIMIT_NOFILE's soft limit less the descriptors open now and the reserve; None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    open_now = len(os.listdir('/proc/self/fd')) if os.path.isdir('/proc/self/fd') else 0
    return soft - open_now - _RESERVED_FDS


def accept_backlog() -> int:
    """The listen backlog (also asyncio's accept burst): a sixteenth of the free descriptors, within 64..2048."""
    free = _descriptors_free()
    return _BACKLOG_MAX if free is None else min(max(free // 16, _BACKLOG_MIN), _BACKLOG_MAX)


def connection_cap(max_connections: int, backlog: int | None = None) -> int:
    """`max_connections`, lowered to fit RLIMIT_NOFILE with the descriptors open now, a reserve, and the accept
    bursts of `backlog` (default `accept_backlog()`) in flight (see `_BURSTS_IN_FLIGHT`)."""
    free = _descriptors_free()
    if free is None:
        return max_connections
    fits = free - _BURSTS_IN_FLIGHT * (accept_backlog() if backlog is None else backlog)
    if fits < max_connections:
        logger.info('connection cap %d (%d descriptors free)', max(fits, 1), free)
    return max(min(max_connections, fits), 1)
