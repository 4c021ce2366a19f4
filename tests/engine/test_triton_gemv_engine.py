"""The engine on CUDA with the one-row Triton GEMV (the default; `LMDEPLOY_TRITON_GEMV`, read when the `cuda`
backend is imported, so each run is a child process) against the same backend with `LMDEPLOY_TRITON_GEMV=0`
(cuBLAS), both measured against the default backend on the CPU in float32: one request at a time, so every decode
step's linears (the head included) are one-row GEMVs. The GEMV run's logits must be no less accurate than the
cuBLAS run's (the margin of `test_cuda_engine.py`): the two differ only in the linears, so the other CUDA kernels'
own half-precision error (which in float16 exceeds the CPU backend's) is in both. The MoE GEMV (the default,
`LMDEPLOY_MOE_GEMV=0` turns it off; `kernels/cuda/moe_gemv.py`) is checked the same way on Qwen3-Next's sparse
layers.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.messages import SamplingParams

pytestmark = pytest.mark.gpu

COMMON = dict(block_size=16, kernel_block_size=8, num_gpu_blocks=256, max_prefill_token_num=64)
PROMPTS = [[5, 9, 13], list(range(40, 110)), [700, 3, 3, 81, 2, 19, 640], list(range(900, 870, -1))]
NEW_TOKENS = 6

_CHILD = '''
import sys, torch
from lmdeploy.pytorch.backends.base import OpType
from lmdeploy.pytorch.backends.cuda import BACKEND, triton_gemv_linear
from lmdeploy.pytorch.kernels.cuda import moe
import tests.engine.test_triton_gemv_engine as t
path, dtype, out, switch, on = sys.argv[1:6]
used = {'LMDEPLOY_TRITON_GEMV': BACKEND.build(OpType.Linear) is triton_gemv_linear,
        'LMDEPLOY_MOE_GEMV': moe._MOE_GEMV}[switch]
assert used == (on == '1'), f'{switch}={on} ignored'
torch.save(t.run_one_by_one(path, dict(device_type='cuda', dtype=dtype)), out)
'''


def run_one_by_one(path: str, config: dict) -> list[torch.Tensor]:
    """Each prompt alone (decode batch 1), greedy: its collected logits (prompt end and every decode step)."""
    engine = Engine(path, PytorchEngineConfig(**config, **COMMON))
    logits = []
    for prompt in PROMPTS:
        seq = engine.add_request(prompt, SamplingParams(max_new_tokens=NEW_TOKENS), collect_logits=True)
        while engine.has_work:
            engine.step()
        logits.append(engine.pop_collected_logits(seq).float().cpu())
    return logits


def run_child(path: str, dtype: str, out, switch: str, on: str) -> list[torch.Tensor]:
    """`run_one_by_one` on CUDA in a child process with the environment variable `switch` set to `on`."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, switch: on, 'PYTHONPATH': os.pathsep.join([root, os.environ.get('PYTHONPATH', '')])}
    proc = subprocess.run([sys.executable, '-c', _CHILD, path, dtype, str(out), switch, on], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out)


def compare_switch(path: str, tmp_path, dtype: str, switch: str) -> None:
    """The run with `switch=1` no less accurate than with `switch=0`, both against the CPU backend in float32, on
    the rows every run was fed alike."""
    truth = run_one_by_one(path, dict(device_type='cpu', dtype='float32'))
    base, got = (run_child(path, dtype, tmp_path / f'logits{on}.pt', switch, on) for on in ('0', '1'))
    decode_rows = 0
    for prompt, ref, b, g in zip(PROMPTS, truth, base, got):
        # Rows fed the same tokens in every run: the prompt's, then the decode steps while every run's greedy token
        # equals the truth's, and the first step where one differs (its own inputs still agree).
        n = len(prompt)
        agree = (b.argmax(-1) == ref.argmax(-1))[n - 1:] & (g.argmax(-1) == ref.argmax(-1))[n - 1:]
        rows = min(n + int(agree.cumprod(0).sum()), len(ref), len(b), len(g))
        decode_rows += rows - n
        err = (g[:rows] - ref[:rows]).abs().max().item()
        base_err = (b[:rows] - ref[:rows]).abs().max().item()
        assert err <= 2 * base_err + 1e-2, f'{dtype} {switch}=1: max abs err {err} vs {base_err} with it 0'
    assert decode_rows > 0, f'{dtype}: every run left the truth at the prompt end: no decode step compared'


@pytest.mark.parametrize('arch', ['qwen3_5', 'qwen3_next'])
@pytest.mark.parametrize('dtype', ['bfloat16', 'float16'])
def test_engine_with_triton_gemv_matches_default_backend(tiny_model_factory, tmp_path, arch, dtype):
    compare_switch(tiny_model_factory(arch), tmp_path, dtype, 'LMDEPLOY_TRITON_GEMV')


@pytest.mark.parametrize('dtype', ['bfloat16', 'float16'])
def test_engine_with_moe_gemv_matches_fused_moe(tiny_model_factory, tmp_path, dtype):
    """Qwen3-Next's sparse MoE layers at batch 1 through `moe_gemv.py` (the default, `LMDEPLOY_MOE_GEMV=1`) against
    `fused_moe`'s launches."""
    compare_switch(tiny_model_factory('qwen3_next'), tmp_path, dtype, 'LMDEPLOY_MOE_GEMV')
