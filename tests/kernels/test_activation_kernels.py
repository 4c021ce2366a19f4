"""The `cuda` backend's fused gated activations (`kernels/cuda/activation.py`) against torch's unfused pairs
(`backends/default/elementwise.py`, what transformers computes): `silu_and_mul` (`F.silu(gate) * up`) and
`sigmoid_gate_mul` (`x * torch.sigmoid(gate)`).

Shapes on purpose: a single row, widths that are not a multiple of the kernel's block (one masked tail, and a
tail in a second block), extra leading dimensions, zero rows, rows inside a wider NaN-padded buffer (the padding
must never be read), and gates that are per-head slices of a query projection, as in gated attention.
`@pytest.mark.gpu` tests run on CUDA in fp32 / bf16 / fp16, one of them inside a captured CUDA graph; `test_cpu_*`
run on CPU tensors under the Triton interpreter in the subprocess `test_activation_kernels_interpreted` starts.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from interpreted import run_cpu_tests_interpreted
from kernel_inputs import randn, strided_copy
from numeric import assert_close

from lmdeploy.pytorch.backends.default import elementwise as ref_elementwise
from lmdeploy.pytorch.kernels.cuda import activation as cuda_act

INTERPRET = os.environ.get('TRITON_INTERPRET') == '1'
interpreted = pytest.mark.skipif(not INTERPRET, reason='runs inside test_activation_kernels_interpreted')

# --------------------------------------------------------------------------------------------- SiLU and mul

# (leading dims..., d): the input is [..., 2d]
SHAPES = [(1, 7), (5, 33), (3, 4, 128), (0, 16), (2, 1100), (9, 1024)]
ALL_DTYPES = pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float16],
                                     ids=['fp32', 'bf16', 'fp16'])


def act_tol(dtype: torch.dtype, device: str) -> dict:
    """Two units in the last place of the output dtype (three under the interpreter): the kernel rounds silu to the
    dtype and then the product, as the reference does, but its exp and division may differ from torch's by float32
    ulps, which can move either rounding by one (and the Triton interpreter truncates float32 -> bf16 / fp16
    instead of rounding to nearest)."""
    if dtype == torch.float32:
        return {'atol': 1e-6, 'rtol': 1e-5}
    return {'atol': 1e-5, 'rtol': (2 if device == 'cuda' else 3) * torch.finfo(dtype).eps}


def assert_mostly_bit_identical(out: torch.Tensor, ref: torch.Tensor, device: str) -> None:
    """Compiled, both roundings are to nearest even like torch's: a float32 ulp of exp / division moves one only
    where the exact value sits next to a rounding boundary, so almost every element is bit-identical."""
    if device == 'cuda' and ref.dtype != torch.float32 and ref.numel() > 1000:
        mismatch = (out.cpu() != ref).float().mean().item()
        assert mismatch < 0.01, f'{mismatch:.2%} of the elements differ from torch'


def check_silu_and_mul(shape, dtype, is_strided: bool, device: str) -> None:
    *lead, width = shape
    x = randn(*lead, 2 * width, gen=torch.Generator().manual_seed(width), dtype=dtype) * 4
    ref = ref_elementwise.silu_and_mul(x)
    x_dev = x.to(device)
    if is_strided:
        x_dev = strided_copy(x_dev, pad=7)
    out = cuda_act.silu_and_mul(x_dev)
    assert out.shape == (*lead, width) and out.dtype == dtype and out.is_contiguous()
    assert_close(out, ref, what=f'silu_and_mul {shape}', **act_tol(dtype, device))
    assert_mostly_bit_identical(out, ref, device)


@pytest.mark.gpu
@ALL_DTYPES
@pytest.mark.parametrize('is_strided', [False, True], ids=['contiguous', 'strided'])
@pytest.mark.parametrize('shape', SHAPES, ids=lambda s: 'x'.join(map(str, s)))
def test_silu_and_mul_matches_torch_gpu(shape, is_strided, dtype):
    check_silu_and_mul(shape, dtype, is_strided, 'cuda')


@pytest.mark.gpu
def test_silu_and_mul_replays_in_cuda_graph_gpu():
    """Captured once, replayed on new values in the same buffer: the grid comes from shapes only, nothing syncs."""
    gen = torch.Generator().manual_seed(0)
    static_x = randn(37, 2 * 1100, gen=gen, dtype=torch.bfloat16).cuda()
    cuda_act.silu_and_mul(static_x)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = cuda_act.silu_and_mul(static_x)
    new_x = randn(37, 2 * 1100, gen=gen, dtype=torch.bfloat16) * 3
    static_x.copy_(new_x.cuda())
    graph.replay()
    assert_close(static_out, ref_elementwise.silu_and_mul(new_x), what='replayed',
                 **act_tol(torch.bfloat16, 'cuda'))


@pytest.mark.parametrize('switch, on', [(None, True), ('1', True), ('0', False)], ids=['unset', '1', '0'])
def test_fused_prefill_is_on_unless_the_switch_is_0(monkeypatch, switch, on):
    from lmdeploy.pytorch.backends.cuda import fused_prefill_enabled
    if switch is None:
        monkeypatch.delenv('LMDEPLOY_FUSED_PREFILL', raising=False)
    else:
        monkeypatch.setenv('LMDEPLOY_FUSED_PREFILL', switch)
    assert fused_prefill_enabled() is on


def test_silu_and_mul_rejects_an_odd_width():
    with pytest.raises(AssertionError, match='gate \\+ up'):
        cuda_act.silu_and_mul(torch.zeros(2, 7))


@interpreted
@ALL_DTYPES
@pytest.mark.parametrize('shape', SHAPES[:5], ids=lambda s: 'x'.join(map(str, s)))
def test_cpu_silu_and_mul(shape, dtype):
    check_silu_and_mul(shape, dtype, is_strided=shape[0] % 2 == 1, device='cpu')


# ------------------------------------------------------------------------------------------ sigmoid output gate

# (leading dims..., H, D)
GATE_SHAPES = [(1, 2, 16), (7, 4, 33), (0, 2, 16), (5, 16, 256), (3, 3, 100), (2, 3, 2, 8)]


def check_sigmoid_gate_mul(shape, dtype, device: str) -> None:
    """x contiguous (an attention output), gate the second half of each head of a [.., H, 2D] projection."""
    *lead, num_heads, head_dim = shape
    gen = torch.Generator().manual_seed(head_dim)
    x = randn(*lead, num_heads, head_dim, gen=gen, dtype=dtype) * 2
    q_gate = randn(*lead, num_heads * 2 * head_dim, gen=gen, dtype=dtype) * 4
    gate = q_gate.unflatten(-1, (num_heads, 2 * head_dim)).chunk(2, dim=-1)[1]
    ref = ref_elementwise.sigmoid_gate_mul(x, gate)
    out = cuda_act.sigmoid_gate_mul(x.to(device), q_gate.to(device).unflatten(
        -1, (num_heads, 2 * head_dim)).chunk(2, dim=-1)[1])
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    assert_close(out, ref, what=f'sigmoid_gate_mul {shape}', **act_tol(dtype, device))
    assert_mostly_bit_identical(out, ref, device)


@pytest.mark.gpu
@ALL_DTYPES
@pytest.mark.parametrize('shape', GATE_SHAPES, ids=lambda s: 'x'.join(map(str, s)))
def test_sigmoid_gate_mul_matches_torch_gpu(shape, dtype):
    check_sigmoid_gate_mul(shape, dtype, 'cuda')


@interpreted
@ALL_DTYPES
@pytest.mark.parametrize('shape', [GATE_SHAPES[i] for i in (0, 1, 2, 4, 5)], ids=lambda s: 'x'.join(map(str, s)))
def test_cpu_sigmoid_gate_mul(shape, dtype):
    check_sigmoid_gate_mul(shape, dtype, 'cpu')


_PREFILL_OPS = ('SiluAndMul', 'SigmoidGateMul', 'RMSNorm', 'GatedRMSNorm')
# the `cuda` backend's builds of `_PREFILL_OPS` in a fresh process (the switch is read at import), one per line
_PRINT_DISPATCH = ('from lmdeploy.pytorch.backends import cuda\nfrom lmdeploy.pytorch.backends.base import OpType\n'
                   f'for op in {_PREFILL_OPS!r}:\n    f = cuda.BACKEND.build(OpType[op])\n'
                   '    print(f.__module__ + "." + f.__name__)')


def _prefill_dispatch(on: bool) -> list[str]:
    """Where each of `_PREFILL_OPS` should dispatch with the fused prefill kernels on or off."""
    from lmdeploy.pytorch.kernels.cuda import rms_norm, rms_norm_rows
    fns = (cuda_act.silu_and_mul, cuda_act.sigmoid_gate_mul, rms_norm_rows.rms_norm, rms_norm_rows.gated_rms_norm) \
        if on else (ref_elementwise.silu_and_mul, ref_elementwise.sigmoid_gate_mul, rms_norm.rms_norm,
                    rms_norm.gated_rms_norm)
    return [f'{f.__module__}.{f.__name__}' for f in fns]


def test_cuda_backend_dispatches_the_fused_prefill_kernels_by_default():
    """The fused kernels unless this process runs with `LMDEPLOY_FUSED_PREFILL=0`."""
    from lmdeploy.pytorch.backends import cuda as cuda_backend
    from lmdeploy.pytorch.backends.base import OpType
    on = cuda_backend._FUSED_PREFILL
    assert on is (os.environ.get('LMDEPLOY_FUSED_PREFILL') != '0')
    built = [cuda_backend.BACKEND.build(OpType[op]) for op in _PREFILL_OPS]
    assert [f'{f.__module__}.{f.__name__}' for f in built] == _prefill_dispatch(on)


def test_fused_prefill_0_dispatches_torch_pairs_and_the_plain_rms_norm():
    env = {**os.environ, 'LMDEPLOY_FUSED_PREFILL': '0'}
    proc = subprocess.run([sys.executable, '-c', _PRINT_DISPATCH], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == _prefill_dispatch(False)


# ------------------------------------------------------------------------------------------------ interpreter

@pytest.mark.skipif(INTERPRET, reason='already running under the interpreter')
def test_activation_kernels_interpreted():
    """Run the `test_cpu_*` tests in a subprocess with TRITON_INTERPRET=1 (set before Triton is imported)."""
    run_cpu_tests_interpreted(__file__)
