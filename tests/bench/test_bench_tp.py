"""`benchmark/bench_tp.py` at TP=1 on the CPU (`--smoke`: tiny float32 shape): every row is measured, the TP=1
engine holds no process group (its all-reduce time per step is 0 by that check, not by assumption), the commit comes
from $LMDEPLOY_COMMIT, and a spent budget skips rows instead of running past it. No speed is asserted."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip('transformers')

SCRIPT = Path(__file__).resolve().parents[2] / 'benchmark' / 'bench_tp.py'


def bench(*args: str) -> dict:
    env = {**os.environ, 'LMDEPLOY_COMMIT': 'c0ffee1'}
    proc = subprocess.run([sys.executable, str(SCRIPT), '--smoke', '--tp', '1', *args], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_tp1_measures_every_row_without_a_process_group():
    result = bench()
    (row,) = result['engines']
    assert result['commit'] == 'c0ffee1' and 'error' not in row, row
    assert row['process_group'] is False and row['reduction_points'] == 2 * result['layers'] and not row['skipped']
    for key in ('decode_tok_s_b1', 'decode_tok_s_b4', 'cold_ttft_ms_64', 'suffix_ttft_ms_45+8'):
        assert row[key] > 0, key
    assert row['suffix_cached_tokens'] == 45     # the suffix request hit its whole served prefix
    assert result['allreduce']['1'] and all(v == {'op_us': 0.0, 'per_step_ms': 0.0}
                                            for v in result['allreduce']['1'].values())


def test_a_spent_budget_skips_the_rows_and_still_reports():
    (row,) = bench('--budget-s', '0')['engines']
    assert row['skipped'] == ['decode_tok_s_b1', 'decode_tok_s_b4', 'cold_ttft_ms_64', 'suffix_ttft_ms_45+8']
