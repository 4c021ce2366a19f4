"""Runs `Engine.step()` on a background thread while there is work; callers talk to it only through
`Engine.add_request` / `abort_request` and their output callbacks.

Liveness signal (read from any thread, for a watchdog): `is_alive` (the thread runs and was not closed) and
`step_started_at` (`time.monotonic()` when the running step began; None between steps). Output callbacks run
inside a step, so a callback reading `step_started_at` gets the start of the step that produced its output.
"""
from __future__ import annotations

import logging
import threading
import time

from .engine import Engine

logger = logging.getLogger('lmdeploy')


class EngineLoop:

    def __init__(self, engine: Engine):
        self.engine = engine
        self._stop = threading.Event()
        self.step_started_at: float | None = None
        self._thread = threading.Thread(target=self._run, name='lmdeploy-engine', daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            if not self._stop.is_set():
                logger.critical('the engine loop thread ended unexpectedly')

    def _loop(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            if engine.fatal_error is not None and not engine.has_work:
                logger.critical('the engine stopped: %s', engine.fatal_error)
                return  # the thread ends: watchdogs see a dead engine, `add_request` refuses with the reason
            if not engine.has_work:
                engine.wakeup.wait(timeout=0.5)
                engine.wakeup.clear()
                continue
            try:
                self.step_started_at = time.monotonic()
                try:
                    engine.step()
                finally:
                    self.step_started_at = None
                if engine.last_step_idle:
                    # Nothing ran (e.g. waiting for memory): back off instead of spinning.
                    engine.wakeup.wait(timeout=0.005)
                    engine.wakeup.clear()
            except Exception:  # the loop must survive anything a step throws
                logger.exception('engine step failed')
                engine.wakeup.wait(timeout=0.05)
                engine.wakeup.clear()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    @property
    def is_closed(self) -> bool:
        """`close()` was called (the loop stopped on purpose)."""
        return self._stop.is_set()

    @property
    def thread_id(self) -> int | None:
        return self._thread.ident

    def close(self) -> None:
        """Stop the thread, then the engine's tensor-parallel workers (if any)."""
        self._stop.set()
        self.engine.wakeup.set()
        self._thread.join(timeout=30)
        self.engine.close()
