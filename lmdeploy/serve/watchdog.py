"""`EngineWatchdog`: watches an `AsyncEngine`'s loop thread and turns a dead loop or a hung step into errors.

A thread of its own (it must keep working when the event loop or the engine thread is stuck) checks every
`interval` seconds, from the loop's liveness signal (`EngineLoop.is_alive`, `step_started_at`):
- `DEAD`: the engine thread ended (or the loop was closed). Every streaming request is failed
  (`finish_reason='error'`): nothing would ever answer it. It stays dead.
- `HUNG`: the running step started more than `timeout` seconds ago. Once per hung step: the engine thread's stack
  is logged and every streaming request is failed and aborted: the step's batch, and the queued requests too,
  since they wait on the same thread (a request arriving meanwhile is refused by admission). When the step
  returns, the state is `OK` again.
`state` is read by `/health` (503 unless `OK`) and by admission (503 for new requests unless `OK`).
"""
from __future__ import annotations

import enum
import logging
import sys
import threading
import time
import traceback

from .async_engine import AsyncEngine

logger = logging.getLogger('lmdeploy')


class Liveness(enum.Enum):
    OK = 'ok'
    HUNG = 'engine_hung'
    DEAD = 'engine_dead'


class EngineWatchdog:

    def __init__(self, async_engine: AsyncEngine, timeout: float, interval: float = 0.25):
        self.async_engine = async_engine
        self.timeout = timeout
        self.interval = min(interval, timeout / 4)
        self.state = Liveness.OK
        self.num_failed = 0       # requests this watchdog failed
        self._hung_step: float | None = None   # start of the step already reported as hung
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name='lmdeploy-watchdog', daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if self.async_engine.engine_loop.is_closed:   # closed on purpose: nothing to report
                self.state = Liveness.DEAD
                self._fail(self.async_engine.live_request_ids, 'the engine was closed')
                return
            self.check()

    def check(self) -> Liveness:
        """One look at the engine loop (also called by tests); updates `state` and fails what it must."""
        loop = self.async_engine.engine_loop
        if not loop.is_alive:
            if self.state is not Liveness.DEAD:
                logger.error('the engine loop is not running: failing every request, /health is 503')
            self.state = Liveness.DEAD
            self._fail(self.async_engine.live_request_ids, 'the engine loop stopped')
            return self.state
        started = loop.step_started_at
        if started is None or time.monotonic() - started <= self.timeout:
            self.state = Liveness.OK
            return self.state
        self.state = Liveness.HUNG
        if self._hung_step != started:
            self._hung_step = started
            frame = sys._current_frames().get(loop.thread_id)
            stack = ''.join(traceback.format_stack(frame)) if frame is not None else '(no stack)'
            live = self.async_engine.live_request_ids
            logger.error('engine step running for %.1f s (--watchdog-timeout %g): failing %d requests; '
                         'engine thread stack:\n%s', time.monotonic() - started, self.timeout, len(live), stack)
            self._fail(live, f'the engine step hung for more than {self.timeout:g} s (--watchdog-timeout)')
        return self.state

    def _fail(self, seq_ids, error: str) -> None:
        self.num_failed += self.async_engine.fail_requests(seq_ids, 'error', error)

    def close(self) -> None:
        self._stop.set()
