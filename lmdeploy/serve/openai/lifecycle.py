"""`GracefulServer`: uvicorn's server with a bounded drain on SIGTERM / SIGINT and exit codes that say what happened.

First signal: admission stops (new generation requests get 503 `server_shutting_down`, `/health` 503 `draining`)
while the requests in flight go on. `grace` bounds the whole shutdown: when no request is left, or at
`grace - exit_reserve(grace)` (the time it takes to write the last responses, close connections and the engine),
every request still streaming is ended with `finish_reason='abort'` and an OpenAI error body (a stream gets an
error event and `[DONE]`, a plain request a 503), and the server stops, so the process has exited by `grace`.
A second signal shortens the grace period to zero. The signal is not re-raised afterwards (uvicorn does so,
which made the process exit -15).

Exit codes (`ExitCode`): 0 stopped by a signal, every client answered (drained, or aborted at the deadline);
1 the engine loop had died (the process should be restarted and the failure looked at); 3 start-up failed
(uvicorn's code: the app could not start).
"""
from __future__ import annotations

import contextlib
import enum
import logging
import signal
import threading
import time

import uvicorn

from ..async_engine import AsyncEngine
from ..watchdog import EngineWatchdog, Liveness
from .admission import Admission
from .connections import accept_backlog, connection_cap, guarded_protocol, raise_descriptor_limit

logger = logging.getLogger('lmdeploy')
SHUTDOWN_ERROR = 'the server is shutting down: the request was aborted at the end of the grace period'
_ABORT_WAIT_S = 5.0   # after aborting, how long responses get to be written out


def exit_reserve(grace: float) -> float:
    """Seconds of the grace period kept for stopping after the aborts (measured: about 1 s on a CPU box)."""
    return min(2.0, grace / 2)


class ExitCode(enum.IntEnum):
    OK = 0
    ENGINE_DEAD = 1
    STARTUP_FAILURE = 3


class GracefulServer(uvicorn.Server):

    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine, admission: Admission,
                 watchdog: EngineWatchdog, grace: float):
        super().__init__(config)
        self.async_engine = async_engine
        self.admission = admission
        self.watchdog = watchdog
        self.grace = grace
        self.deadline: float | None = None     # time.monotonic() at which the rest is aborted
        self.num_aborted = 0
        self._drain_started = 0.0

    # ---- signals ---------------------------------------------------------------------------------------------
    def handle_exit(self, sig: int, frame) -> None:
        now = time.monotonic()
        if self.deadline is None:
            self.deadline = now + self.grace - exit_reserve(self.grace)
            self._drain_started = now
            self.admission.draining = True
            logger.info('signal %d: draining %d requests for up to %g s (another signal aborts them now)',
                        sig, self.admission.in_flight, self.grace)
        else:
            self.deadline = now
            logger.info('signal %d again: aborting the requests in flight now', sig)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    # ---- drain -----------------------------------------------------------------------------------------------
    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        if self.deadline is None:
            return False
        now = time.monotonic()
        if now >= self.deadline:
            live = self.async_engine.live_request_ids
            if live:
                self.num_aborted += self.async_engine.fail_requests(live, 'abort', SHUTDOWN_ERROR)
            if self.admission.in_flight == 0 or now >= self.deadline + _ABORT_WAIT_S:
                return self._stop()
        elif self.admission.in_flight == 0:
            return self._stop()
        return False

    def _stop(self) -> bool:
        logger.info('shutdown after %.1f s: %d requests aborted, %d still writing', time.monotonic() -
                    self._drain_started, self.num_aborted, self.admission.in_flight)
        self.should_exit = True
        return True

    def exit_code(self) -> ExitCode:
        if self.watchdog.state is Liveness.DEAD:
            return ExitCode.ENGINE_DEAD
        return ExitCode.OK


def run_app(app, sock, log_level: str = 'info') -> ExitCode:
    """Serve `app` (from `create_app`) on the bound socket `sock` until a signal stops it."""
    state = app.state.server
    config = state.config
    raise_descriptor_limit()
    backlog = accept_backlog()
    protocol = guarded_protocol(connection_cap(config.max_connections, backlog), config.timeout_header)
    state.metrics.registry.register(protocol.guard)
    uvicorn_config = uvicorn.Config(app, log_level=log_level.lower(), http=protocol,
                                    timeout_keep_alive=config.timeout_keep_alive,
                                    timeout_graceful_shutdown=_ABORT_WAIT_S, backlog=backlog)
    server = GracefulServer(uvicorn_config, state.async_engine, state.admission, state.watchdog,
                            config.timeout_graceful_shutdown)
    try:
        server.run(sockets=[sock])
    except SystemExit as exc:  # uvicorn exits with 3 when the app cannot start
        if exc.code == ExitCode.STARTUP_FAILURE:
            return ExitCode.STARTUP_FAILURE
        raise
    return server.exit_code()

