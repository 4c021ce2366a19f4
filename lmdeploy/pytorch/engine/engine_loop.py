"""Runs `Engine.step()` on a background thread while there is work; callers talk to it only through
`Engine.add_request` / `abort_request` and their output callbacks.
"""
from __future__ import annotations

import logging
import threading

from .engine import Engine

logger = logging.getLogger('lmdeploy')


class EngineLoop:

    def __init__(self, engine: Engine):
        self.engine = engine
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name='lmdeploy-engine', daemon=True)
        self._thread.start()

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            if not engine.has_work:
                engine.wakeup.wait(timeout=0.5)
                engine.wakeup.clear()
                continue
            try:
                engine.step()
                if engine.last_step_idle:
                    # Nothing ran (e.g. waiting for memory): back off instead of spinning.
                    engine.wakeup.wait(timeout=0.005)
                    engine.wakeup.clear()
            except Exception:  # the loop must survive anything a step throws
                logger.exception('engine step failed')
                engine.wakeup.wait(timeout=0.05)
                engine.wakeup.clear()

    def close(self) -> None:
        self._stop.set()
        self.engine.wakeup.set()
        self._thread.join(timeout=30)
