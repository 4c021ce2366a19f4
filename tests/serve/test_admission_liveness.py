"""Admission control (429 with Retry-After beyond --max-concurrent-requests, later requests served), the engine
watchdog (a hung step fails its requests and turns /health to 503 until it returns; a killed engine loop turns
/health to 503 and fails every request) and /metrics behind the API key. Live servers on loopback; every wait is
bounded in time."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from live_server import MODEL
from test_api_server import API_KEY

from lmdeploy.serve.async_engine import AsyncEngine
from lmdeploy.serve.openai.api_server import create_app
from lmdeploy.serve.server_config import ServerConfig
from lmdeploy.serve.watchdog import Liveness

LONG = {'model': MODEL, 'prompt': [5, 6, 7, 8], 'max_tokens': 100_000, 'ignore_eos': True, 'temperature': 0,
        'stream': True}
SHORT = {'model': MODEL, 'prompt': [5, 6, 7], 'max_tokens': 2}


def wait_for(predicate, timeout: float = 10.0, what: str = 'condition'):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f'timed out waiting for {what}'
        time.sleep(0.02)


def idle(async_engine: AsyncEngine) -> bool:
    scheduler = async_engine.engine.scheduler
    return not (scheduler.running or scheduler.waiting or async_engine.engine.has_work)


class Stream:
    """A streaming completion read on its own thread; `events` fills as they arrive."""

    def __init__(self, url: str, body: dict):
        self.events: list = []
        self.status: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict) -> None:
        with httpx.stream('POST', f'{url}/v1/completions', json=body, timeout=60) as response:
            self.status = response.status_code
            for line in response.iter_lines():
                if line.startswith('data: '):
                    self.events.append(line[6:] if line == 'data: [DONE]' else json.loads(line[6:]))
                if self._stop.is_set():
                    return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()


def test_beyond_the_admission_limit_429_with_retry_after_then_served(async_engine, live_server_factory):
    server = live_server_factory(create_app(async_engine, None, MODEL,
                                            config=ServerConfig(max_concurrent_requests=2)), async_engine)
    streams = [Stream(server.url, LONG) for _ in range(2)]
    try:
        wait_for(lambda: all(len(s.events) >= 2 for s in streams), what='both streams running')
        refused = [httpx.post(f'{server.url}/v1/completions', json=SHORT, timeout=10) for _ in range(3)]
        for response in refused:
            assert response.status_code == 429, response.text
            assert response.headers['Retry-After'] == '1'
            assert response.json()['error']['code'] == 'rate_limit_exceeded'
        assert httpx.get(f'{server.url}/health').status_code == 200  # not a liveness problem
    finally:
        for s in streams:
            s.close()
    # The slots free as the streams end; a later request is served.
    response = wait_for(lambda: (r := httpx.post(f'{server.url}/v1/completions', json=SHORT, timeout=30))
                        .status_code == 200 and r, what='a request admitted again')
    assert response.json()['usage']['completion_tokens'] == 2
    m = server.metrics()
    assert m[('lmdeploy:rejected_requests_total', (('status', '429'),))] == 3
    assert m[('lmdeploy:request_queue_time_seconds_count', ())] >= 3
    wait_for(lambda: idle(async_engine), what='engine idle')
    assert wait_for(lambda: server.metrics()[('lmdeploy:num_requests_admitted', ())] == 0 or None) is True


def test_hung_step_fails_its_requests_and_health_recovers(async_engine, live_server_factory):
    config = ServerConfig(watchdog_timeout=0.5)
    server = live_server_factory(create_app(async_engine, None, MODEL, config=config), async_engine)
    engine, release = async_engine.engine, threading.Event()
    forward = engine.agent.forward

    def hanging_forward(*args, **kwargs):   # the model forward hangs (a stuck kernel, a deadlocked collective)
        release.wait(30)
        return forward(*args, **kwargs)

    engine.agent.forward = hanging_forward
    try:
        start = time.monotonic()
        response = httpx.post(f'{server.url}/v1/completions', json={**SHORT, 'max_tokens': 50}, timeout=30)
        waited = time.monotonic() - start
        assert response.status_code == 500 and 'watchdog-timeout' in response.json()['error']['message']
        assert 0.5 <= waited < 5, waited
        health = httpx.get(f'{server.url}/health')
        assert health.status_code == 503 and health.json()['status'] == Liveness.HUNG.value
        refused = httpx.post(f'{server.url}/v1/completions', json=SHORT)
        assert refused.status_code == 503 and refused.json()['error']['code'] == 'engine_hung'
    finally:
        engine.agent.forward = forward
        release.set()
    wait_for(lambda: httpx.get(f'{server.url}/health').status_code == 200, what='health back to 200')
    assert httpx.post(f'{server.url}/v1/completions', json=SHORT, timeout=30).status_code == 200
    wait_for(lambda: idle(async_engine), what='engine idle')
    engine.check_integrity()
    blocks = engine.scheduler.block_manager
    assert blocks.num_free == blocks.num_blocks


def test_metrics_behind_the_api_key(async_engine, live_server_factory):
    config = ServerConfig(enable_metrics_auth=True)
    guarded = live_server_factory(create_app(async_engine, [API_KEY], MODEL, config=config), async_engine)
    assert httpx.get(f'{guarded.url}/metrics').status_code == 401
    assert httpx.get(f'{guarded.url}/metrics', headers={'Authorization': f'Bearer {API_KEY}'}).status_code == 200
    assert httpx.get(f'{guarded.url}/health').status_code == 200
    open_metrics = live_server_factory(create_app(async_engine, [API_KEY], MODEL), async_engine)
    assert httpx.get(f'{open_metrics.url}/metrics').status_code == 200


@pytest.mark.filterwarnings('ignore::pytest.PytestUnhandledThreadExceptionWarning')
def test_killed_engine_loop_turns_health_503_and_fails_requests(async_engine, live_server_factory):
    # Runs last in this module: the engine loop does not come back.
    server = live_server_factory(create_app(async_engine, None, MODEL), async_engine)
    stream = Stream(server.url, LONG)
    wait_for(lambda: len(stream.events) >= 2, what='stream running')
    engine = async_engine.engine

    def killed():
        raise SystemExit('killed by the test')   # not an Exception: the loop thread ends

    engine.step = killed
    start = time.monotonic()
    health = wait_for(lambda: (h := httpx.get(f'{server.url}/health', timeout=5)).status_code == 503 and h,
                      timeout=5, what='health 503')
    print(f'\nkilled engine loop: /health 503 after {time.monotonic() - start:.2f} s')
    assert health.json()['status'] == Liveness.DEAD.value
    wait_for(lambda: stream.done, what='the stream to end')
    assert stream.events[-1] == '[DONE]'
    assert 'engine loop stopped' in stream.events[-2]['error']['message']
    refused = httpx.post(f'{server.url}/v1/completions', json=SHORT)
    assert refused.status_code == 503 and refused.json()['error']['code'] == 'engine_dead'
