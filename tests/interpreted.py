"""Triton kernels on the CPU: a kernel test module's `test_cpu_*` tests run again in a subprocess under
`TRITON_INTERPRET=1`, which must be set before Triton is imported (so never in the pytest process itself). The
module marks those tests to skip unless the variable is set, and calls `run_cpu_tests_interpreted(__file__)` from
one test that skips under the interpreter."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cpu_tests_interpreted(test_file: str, selector: str = 'test_cpu_') -> None:
    """Fails with the subprocess's output unless every selected test of `test_file` passed (none skipped)."""
    pytest.importorskip('triton')
    env = {**os.environ, 'TRITON_INTERPRET': '1', 'CUDA_VISIBLE_DEVICES': ''}
    cmd = [sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', test_file, '-k', selector]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, f'interpreted kernels failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}'
    assert ' passed' in proc.stdout and 'skipped' not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]
