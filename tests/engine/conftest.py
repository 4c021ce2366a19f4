"""Fixtures of the engine tests (the session-wide ones, `tiny_model_factory` and `make_engine`, are in
tests/conftest.py, which also holds torch to one intra-op thread)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope='module')
def model_path(tiny_model_factory):
    """`model_path(arch)`: the default tiny checkpoint of `arch`."""
    return lambda arch: tiny_model_factory(arch)
