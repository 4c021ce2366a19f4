"""Smoke test of `benchmark/bench_mtp_engine.py --smoke` (tiny dummy-weight shape, CPU): every mode runs, and each
forced-acceptance run emits exactly its target number of tokens per verify step (no speed asserted)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip('transformers')


def test_mtp_engine_benchmark_smoke_forces_every_acceptance_length():
    path = Path(__file__).resolve().parents[2] / 'benchmark' / 'bench_mtp_engine.py'
    spec = importlib.util.spec_from_file_location('bench_mtp_engine', path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        result = module.main(['--smoke', '--batches', '2', '--draft-tokens', '2'])
    finally:
        sys.modules.pop(spec.name, None)
        sys.modules.pop('bench_mtp_decode', None)
    (row,) = result['rows']
    assert row['plain'] > 0 and row['mtp'] > 0
    for a in (1, 2, 3):
        assert row[f'forced_{a}_stats']['mean_accepted_length'] == pytest.approx(a)
        assert row[f'forced_{a}'] > 0
