"""Shared fixtures: tiny random-weight checkpoints (built once per session); `numeric.py` holds the comparisons."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')
# pytest-xdist over several GPUs (scripts/gpu_check.sh GPU_TEST_WORKERS): LMDEPLOY_TEST_GPUS lists the device ids and
# worker gwN takes id N mod their count. Set here, at import, before anything initialises CUDA in the worker.
if os.environ.get('LMDEPLOY_TEST_GPUS') and os.environ.get('PYTEST_XDIST_WORKER'):
    _ids = os.environ['LMDEPLOY_TEST_GPUS'].split(',')
    os.environ['CUDA_VISIBLE_DEVICES'] = _ids[int(os.environ['PYTEST_XDIST_WORKER'].removeprefix('gw')) % len(_ids)]
# Tiny models gain nothing from intra-op threads, and engine loop threads plus OpenMP pools oversubscribe a small CI
# machine badly (spinning workers made some files 10x slower).
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason='needs a CUDA device')
    for item in items:
        if 'gpu' in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope='session')
def tiny_model_factory(tmp_path_factory):
    """`factory(arch, **config_overrides) -> path`, cached per distinct argument set for the session."""
    from lmdeploy.demo_model import save_tiny_model
    cache: dict = {}

    def factory(arch: str = 'qwen3', seed: int = 0, **overrides) -> str:
        key = (arch, seed, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f'{arch}-model')
            cache[key] = save_tiny_model(str(path), arch=arch, config_overrides=overrides or None, seed=seed)
        return cache[key]

    return factory


@pytest.fixture(scope='session')
def make_engine():
    """`make_engine(path, cache=None, **config) -> Engine` on the CPU (see `tests/engines.py`)."""
    from engines import engine_factory
    return engine_factory(block_size=16, kernel_block_size=8, num_gpu_blocks=64, max_batch_size=8,
                          max_prefill_token_num=256)
