"""Smoke test of `benchmark/bench_prefix_match.py` on a tiny grid (no timing asserted)."""
from __future__ import annotations

import pytest
from bench_scripts import bench_script


@pytest.fixture(scope='module')
def bench():
    with bench_script('bench_prefix_match') as module:
        yield module


@pytest.mark.parametrize('dense', [False, True])
def test_match_benchmark_finds_the_prefix_end(bench, dense):
    # 4 blocks of 16 tokens; hybrid: 20 checkpoints, one at the prefix end; dense: the same branches, no checkpoints.
    setup = bench.build(prefix_len=64, num_checkpoints=20, block_size=16, dense=dense)
    row = bench.measure(setup, repeats=1)
    assert row['hit'] == 64
    assert (row['cands'] == 0) == dense
