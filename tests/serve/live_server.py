"""A real uvicorn server on a free loopback port in a background thread, for tests that drive it over HTTP."""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import uvicorn


class Live:

    def __init__(self, url: str, app):
        self.url = url
        self.app = app

    def client(self, api_key: str = 'unused') -> openai.OpenAI:
        return openai.OpenAI(base_url=f'{self.url}/v1', api_key=api_key, max_retries=0, timeout=60)


@contextlib.contextmanager
def live_server(app) -> Iterator[Live]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(('127.0.0.1', 0))
    url = f'http://127.0.0.1:{sock.getsockname()[1]}'
    server = uvicorn.Server(uvicorn.Config(app, log_level='warning', timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={'sockets': [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f'{url}/health', timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, 'server did not come up'
            time.sleep(0.05)
        yield Live(url, app)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
