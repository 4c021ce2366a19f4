"""Triton kernels on the CPU: a kernel test module's `test_cpu_*` tests run again in a subprocess under
`TRITON_INTERPRET=1`, which must be set before Triton is imported (so never in the pytest process itself). The
module marks those tests to skip unless the variable is set, and calls `run_cpu_tests_interpreted(__file__)` from
one test that skips under the interpreter.

The other form (case tables: `kernels/test_kv_cache_kernels.py`, `kernels/test_cuda_kernels_attention.py`): a
module keeps CPU cases per kernel and a `run_interpreted(kernel)` that passes them to `check_cases_interpreted`;
one test per kernel calls `run_checks_interpreted(__file__, kernel, num_cases)`, which imports the module in a
subprocess and runs them."""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


def run_cpu_tests_interpreted(test_file: str, selector: str = 'test_cpu_') -> None:
    """Fails with the subprocess's output unless every selected test of `test_file` passed (none skipped)."""
    pytest.importorskip('triton')
    env = {**os.environ, 'TRITON_INTERPRET': '1', 'CUDA_VISIBLE_DEVICES': ''}
    cmd = [sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', test_file, '-k', selector]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, f'interpreted kernels failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}'
    assert ' passed' in proc.stdout and 'skipped' not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]


def run_checks_interpreted(test_file: str, kernel: str, num_cases: int) -> None:
    """Runs `run_interpreted(kernel)` of the module `test_file` in a subprocess under `TRITON_INTERPRET=1` (its
    folder and tests/ on the path); fails with its output unless it checked all `num_cases` cases."""
    here = Path(test_file).resolve().parent
    code = f'import sys; sys.path[:0] = [{str(here)!r}, {TESTS!r}]; import {Path(test_file).stem} as t; ' \
           f't.run_interpreted({kernel!r})'
    env = {**os.environ, 'TRITON_INTERPRET': '1'}
    result = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count('ok ') == num_cases


def check_cases_interpreted(check: Callable[[object, str], None], cases: Sequence) -> None:
    """Inside the interpreter subprocess: `check(case, 'cpu')` for every case, one `ok <id>` line each."""
    assert os.environ.get('TRITON_INTERPRET') == '1'
    for case in cases:
        check(case, 'cpu')
        print(f'ok {case.id}')
