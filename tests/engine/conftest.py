"""Fixtures of the engine tests (the session-wide ones, `tiny_model_factory` and `make_engine`, are in
tests/conftest.py, which also holds torch to one intra-op thread)."""
from __future__ import annotations

import pytest
from mtp_reference import mtp_checkpoint_builder
from mtp_runs import MODELS


@pytest.fixture(scope='module')
def model_path(tiny_model_factory):
    """`model_path(arch)`: the default tiny checkpoint of `arch`."""
    return lambda arch: tiny_model_factory(arch)


@pytest.fixture(scope='module')
def mtp_model(tiny_model_factory, tmp_path_factory):
    """`mtp_model(name='qwen3_5')`: a tiny checkpoint of `mtp_runs.MODELS[name]` with random `mtp.*` weights."""
    return mtp_checkpoint_builder(tiny_model_factory, tmp_path_factory, MODELS, default='qwen3_5')
