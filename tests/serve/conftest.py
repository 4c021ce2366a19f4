"""Fixtures of the server tests: a module's live uvicorn servers (`live_server_factory`) and the default tiny
engine behind them (`async_engine`, Qwen3; a module that needs another engine defines its own)."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
from live_server import MODEL, LiveServer, Running, engine_config, start_server, stop_server, wait_until_healthy

from lmdeploy.serve.async_engine import AsyncEngine


@pytest.fixture(scope='module')
def live_server_factory() -> Iterator:
    """`factory(app, async_engine) -> LiveServer`: uvicorn on a free loopback port, stopped at module end."""
    running: list[Running] = []

    def factory(app, async_engine: AsyncEngine) -> LiveServer:
        running.append(start_server(app))
        wait_until_healthy(running[-1].url)
        return LiveServer(running[-1].url, async_engine)

    yield factory
    for server in running:
        stop_server(server)


@pytest.fixture(scope='module')
def async_engine(tiny_model_factory) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(tiny_model_factory('qwen3'), engine_config(), model_name=MODEL)
    yield engine
    engine.close()
