"""A tiny request's latency beside a storm of large request bodies, against a live OpenAI-compatible server.

The figure behind "tokenization off the event loop" (docs/reliability.md): a server that tokenizes megabytes of
prompt on its event loop stalls every other client meanwhile. Measured by `benchmark/bench_server_faults.py` and
asserted by `tests/serve/test_request_limits.py`. Every loop is bounded in count and every wait in time.
"""
from __future__ import annotations

import threading
import time
from typing import NamedTuple

import httpx

TINY_PROMPT = [5, 6, 7]


class StormLatency(NamedTuple):
    baseline: list[float]    # seconds of each tiny request before the storm
    loaded: list[float]      # seconds of each tiny request while the large bodies are being sent
    statuses: list[int]      # HTTP status of every large request sent


def tiny_latency(client: httpx.Client, url: str, model: str, timeout: float = 60.0) -> float:
    """Seconds of one 3-token, 1-new-token completion; it must succeed."""
    start = time.perf_counter()
    response = client.post(f'{url}/v1/completions', json={'model': model, 'prompt': TINY_PROMPT, 'max_tokens': 1},
                           timeout=timeout)
    if response.status_code != 200:
        raise RuntimeError(f'tiny request failed: {response.status_code} {response.text[:500]}')
    return time.perf_counter() - start


def latency_beside_storm(url: str, model: str, body: bytes, num_threads: int, num_samples: int, max_sent: int,
                         tiny_timeout: float = 60.0) -> StormLatency:
    """`num_samples` tiny requests after 3 warm-ups, then `num_samples` more while `num_threads` clients post `body`
    (an encoded chat request, encoded once: clients in this process share its GIL) to /v1/chat/completions back to
    back, `max_sent` at most in all."""
    with httpx.Client() as client:
        for _ in range(3):
            tiny_latency(client, url, model, tiny_timeout)
        baseline = [tiny_latency(client, url, model, tiny_timeout) for _ in range(num_samples)]
        stop, statuses = threading.Event(), []

        def storm() -> None:
            with httpx.Client() as own:
                while not stop.is_set() and len(statuses) < max_sent:
                    statuses.append(own.post(f'{url}/v1/chat/completions', content=body, timeout=60,
                                             headers={'Content-Type': 'application/json'}).status_code)

        threads = [threading.Thread(target=storm) for _ in range(num_threads)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        loaded = [tiny_latency(client, url, model, tiny_timeout) for _ in range(num_samples)]
        stop.set()
        for t in threads:
            t.join(60)
    return StormLatency(baseline, loaded, statuses)
