"""Smoke test of `benchmark/bench_prefix_match.py` on a tiny grid (no timing asserted)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope='module')
def bench():
    path = Path(__file__).resolve().parents[2] / 'benchmark' / 'bench_prefix_match.py'
    spec = importlib.util.spec_from_file_location('bench_prefix_match', path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


@pytest.mark.parametrize('dense', [False, True])
def test_match_benchmark_finds_the_prefix_end(bench, dense):
    # 4 blocks of 16 tokens; hybrid: 20 checkpoints, one at the prefix end; dense: the same branches, no checkpoints.
    setup = bench.build(prefix_len=64, num_checkpoints=20, block_size=16, dense=dense)
    row = bench.measure(setup, repeats=1)
    assert row['hit'] == 64
    assert (row['cands'] == 0) == dense
