"""Smoke test of `benchmark/bench_mtp_decode.py --smoke` (tiny shape, CPU): it runs both step kinds and reports
forced-acceptance tokens/s that scale with the acceptance length (no speed asserted)."""
from __future__ import annotations

import pytest
from bench_scripts import bench_script

pytest.importorskip('transformers')


def test_mtp_benchmark_smoke_reports_every_acceptance_length():
    with bench_script('bench_mtp_decode') as module:
        result = module.main(['--smoke', '--batches', '1', '2', '--draft-tokens', '2'])
    assert [row['batch'] for row in result['rows']] == [1, 2]
    for row in result['rows']:
        per_len = row['spec_tokens_per_s_at_accept_len']
        assert list(per_len) == ['1', '2', '3']
        assert per_len['3'] == pytest.approx(3 * per_len['1'])
        assert row['plain_step_ms'] > 0 and row['spec_step_ms'] > 0
