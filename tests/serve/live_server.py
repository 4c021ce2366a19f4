"""A real uvicorn server on a free loopback port in a background thread, for tests that drive it over HTTP:
`live_server(app)` (a context manager) or the module-scoped `live_server_factory` fixture (tests/serve/conftest.py);
and the OpenAI-server tests' tiny engine (`MODEL`, `engine_config`) with its handle `LiveServer`."""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import NamedTuple

import httpx
import openai
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.serve.async_engine import AsyncEngine

MODEL = 'tiny-qwen3'


def engine_config(**overrides) -> PytorchEngineConfig:
    # a fixed, small KV pool (32k tokens) instead of the 4 GiB CPU default keeps start-up fast
    return PytorchEngineConfig(device_type='cpu', block_size=16, max_batch_size=8, num_gpu_blocks=2048, **overrides)


class Live:

    def __init__(self, url: str, app):
        self.url = url
        self.app = app

    def client(self, api_key: str = 'unused') -> openai.OpenAI:
        return openai.OpenAI(base_url=f'{self.url}/v1', api_key=api_key, max_retries=0, timeout=60)


class LiveServer(NamedTuple):
    """A server of `live_server_factory` and the engine behind it."""
    url: str
    async_engine: AsyncEngine

    def client(self, api_key: str = 'unused') -> openai.OpenAI:
        return openai.OpenAI(base_url=f'{self.url}/v1', api_key=api_key, max_retries=0, timeout=30)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        text = httpx.get(f'{self.url}/metrics').text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}


class Running(NamedTuple):
    url: str
    server: uvicorn.Server
    thread: threading.Thread
    sock: socket.socket


def start_server(app) -> Running:
    """uvicorn serving `app` on a free loopback port, in a daemon thread (not yet known to answer)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(('127.0.0.1', 0))
    url = f'http://127.0.0.1:{sock.getsockname()[1]}'
    server = uvicorn.Server(uvicorn.Config(app, log_level='warning', timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={'sockets': [sock]}, daemon=True)
    thread.start()
    return Running(url, server, thread, sock)


def wait_until_healthy(url: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f'{url}/health', timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, 'server did not come up'
        time.sleep(0.05)


def stop_server(running: Running) -> None:
    running.server.should_exit = True
    running.thread.join(timeout=10)
    running.sock.close()


@contextlib.contextmanager
def live_server(app) -> Iterator[Live]:
    running = start_server(app)
    try:
        wait_until_healthy(running.url)
        yield Live(running.url, app)
    finally:
        stop_server(running)
