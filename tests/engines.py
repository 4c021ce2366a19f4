"""The one engine factory of the tests: a CPU `Engine` over a tiny checkpoint with the test module's small pools.

A module names its defaults once (`make_engine = engine_factory(block_size=16, num_gpu_blocks=64)`); a call overrides
any `PytorchEngineConfig` field, and `cache=` switches prefix caching. The `make_engine` fixture (conftest.py) is
`engine_factory()` for tests that need nothing else.
"""
from __future__ import annotations

from collections.abc import Callable

from lmdeploy import PytorchEngineConfig


def engine_factory(**defaults) -> Callable:
    def make_engine(path: str, cache: bool | None = None, **overrides):
        from lmdeploy.pytorch.engine.engine import Engine
        config = {'device_type': 'cpu', **defaults, **overrides}
        if cache is not None:
            config['enable_prefix_caching'] = cache
        return Engine(path, PytorchEngineConfig(**config))
    return make_engine
