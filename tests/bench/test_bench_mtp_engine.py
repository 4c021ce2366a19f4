"""Smoke test of `benchmark/bench_mtp_engine.py --smoke` (tiny dummy-weight shape, CPU): every mode runs, and each
forced-acceptance run emits exactly its target number of tokens per verify step (no speed asserted)."""
from __future__ import annotations

import pytest
from bench_scripts import bench_script

pytest.importorskip('transformers')


def test_mtp_engine_benchmark_smoke_forces_every_acceptance_length():
    with bench_script('bench_mtp_engine') as module:
        result = module.main(['--smoke', '--batches', '2', '--draft-tokens', '2'])
    (row,) = result['rows']
    assert row['plain'] > 0 and row['mtp'] > 0
    for a in (1, 2, 3):
        assert row[f'forced_{a}_stats']['mean_accepted_length'] == pytest.approx(a)
        assert row[f'forced_{a}'] > 0
