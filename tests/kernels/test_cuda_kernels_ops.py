"""CUDA-backend kernels (`kernels/cuda/`) against the torch references of the default backend.

Two runs share the same checks:
* `@pytest.mark.gpu` tests run every kernel on CUDA, the reference on CPU, on odd shapes (empty and one-token
  sequences, 1/2/3-token segments after a history, grouped value heads, bf16/fp32, strided pools); the gated
  delta rule's are `tests/kernels/test_cuda_gated_delta_rule.py`, the conv's
  `tests/kernels/test_causal_conv1d_kernel.py`.
* `test_cpu_*` tests run the Triton kernels on CPU tensors under the Triton interpreter. They only run inside the
  subprocess started by `test_triton_kernels_interpreted` (TRITON_INTERPRET must be set before Triton is imported).

State pools are views into a wider backing tensor (rows strided in dim 0, gap bytes around each row); after a call
the backing tensor must equal the reference's bit for bit outside the used rows.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from interpreted import run_cpu_tests_interpreted
from kernel_inputs import (
    DTYPES,
    randn,
    strided_copy,
    tol,
)
from numeric import assert_close

from lmdeploy.pytorch.backends.default import elementwise as ref_elementwise
from lmdeploy.pytorch.backends.default.moe import fused_moe as ref_fused_moe
from lmdeploy.pytorch.kernels.cuda import moe as cuda_moe
from lmdeploy.pytorch.kernels.cuda import rms_norm as cuda_norm
from lmdeploy.pytorch.kernels.cuda import rms_norm_rows as cuda_norm_rows
from lmdeploy.pytorch.kernels.cuda import rotary as cuda_rotary

INTERPRET = os.environ.get('TRITON_INTERPRET') == '1'
interpreted = pytest.mark.skipif(not INTERPRET, reason='runs inside test_triton_kernels_interpreted')


# ------------------------------------------------------------------------------------------------------- norms


NORM_SHAPES = [(1, 7), (5, 33), (3, 4, 128), (0, 16), (2, 3, 4096)]


def norm_id(shape) -> str:
    return 'x'.join(map(str, shape))


# the kernel of LMDEPLOY_FUSED_PREFILL=0 and the default one (short rows per program, head slices in place)
NORM_MODULES = pytest.mark.parametrize('norm', [cuda_norm, cuda_norm_rows], ids=['rms_norm', 'rms_norm_rows'])


def check_rms_norm(shape, dtype, zero_centered: bool, strided: bool, device: str, norm=cuda_norm) -> None:
    gen = torch.Generator().manual_seed(0)
    x, weight = randn(*shape, gen=gen, dtype=dtype), randn(shape[-1], gen=gen, dtype=dtype)
    ref = ref_elementwise.rms_norm(x, weight, 1e-6, zero_centered)
    x_dev = x.to(device)
    out = norm.rms_norm(strided_copy(x_dev) if strided else x_dev, weight.to(device), 1e-6, zero_centered)
    assert out.shape == ref.shape and out.dtype == dtype
    assert_close(out, ref, what='rms_norm', **tol(dtype))


def check_gated_rms_norm(shape, dtype, strided: bool, device: str, norm=cuda_norm) -> None:
    gen = torch.Generator().manual_seed(1)
    x, gate = randn(*shape, gen=gen, dtype=dtype), randn(*shape, gen=gen, dtype=dtype)
    weight = randn(shape[-1], gen=gen, dtype=dtype)
    ref = ref_elementwise.gated_rms_norm(x, gate, weight, 1e-6)
    x_dev, gate_dev = x.to(device), gate.to(device)
    if strided:
        x_dev, gate_dev = strided_copy(x_dev), strided_copy(gate_dev, pad=2)
    out = norm.gated_rms_norm(x_dev, gate_dev, weight.to(device), 1e-6)
    assert out.shape == ref.shape and out.dtype == dtype
    assert_close(out, ref, what='gated_rms_norm', **tol(dtype))


def head_slice_copy(x: torch.Tensor, pad: int = 3) -> torch.Tensor:
    """Same values [..., H, D], as the heads of a channel slice of a wider NaN-padded projection [..., pad + H * D +
    pad] (gated DeltaNet's z): the rows of D are not evenly spaced, so they are not a [rows, D] view."""
    width = x.shape[-2] * x.shape[-1]
    wide = torch.full((*x.shape[:-2], width + 2 * pad), float('nan'), dtype=x.dtype, device=x.device)
    wide[..., pad:pad + width] = x.flatten(-2)
    return wide[..., pad:pad + width].unflatten(-1, x.shape[-2:])


HEAD_SHAPES = [(3, 4, 128), (2, 3, 4096), (5, 2, 3, 16), (4, 1, 16), (37, 4, 128)]  # 148 rows: 10 programs of 16


def check_gated_rms_norm_head_slices(shape, dtype, device: str) -> None:
    """The default kernel (`rms_norm_rows`) reads x and gate as head slices of wider projections in place
    ([outer, inner, D])."""
    gen = torch.Generator().manual_seed(2)
    x, gate = randn(*shape, gen=gen, dtype=dtype), randn(*shape, gen=gen, dtype=dtype)
    weight = randn(shape[-1], gen=gen, dtype=dtype)
    ref = ref_elementwise.gated_rms_norm(x, gate, weight, 1e-6)
    x_dev, gate_dev = head_slice_copy(x.to(device), pad=5), head_slice_copy(gate.to(device))
    if shape[-2] > 1:
        rows, _, _, inner = cuda_norm_rows._row_layout(gate_dev)
        assert rows.data_ptr() == gate_dev.data_ptr() and inner == shape[-2], 'the gate was copied'
    out = cuda_norm_rows.gated_rms_norm(x_dev, gate_dev, weight.to(device), 1e-6)
    assert out.shape == ref.shape and out.dtype == dtype and out.is_contiguous()
    assert_close(out, ref, what='gated_rms_norm of head slices', **tol(dtype))


@pytest.mark.gpu
@DTYPES
@pytest.mark.parametrize('shape', HEAD_SHAPES, ids=norm_id)
def test_gated_rms_norm_reads_head_slices_in_place_gpu(shape, dtype):
    check_gated_rms_norm_head_slices(shape, dtype, 'cuda')


@interpreted
@DTYPES
@pytest.mark.parametrize('shape', [HEAD_SHAPES[i] for i in (0, 2, 3, 4)], ids=norm_id)
def test_cpu_gated_rms_norm_head_slices(shape, dtype):
    check_gated_rms_norm_head_slices(shape, dtype, 'cpu')


@pytest.mark.gpu
@NORM_MODULES
@DTYPES
@pytest.mark.parametrize('zero_centered', [False, True], ids=['plain', 'zero_centered'])
@pytest.mark.parametrize('strided', [False, True], ids=['contiguous', 'strided'])
@pytest.mark.parametrize('shape', NORM_SHAPES, ids=norm_id)
def test_rms_norm_gpu(shape, strided, zero_centered, dtype, norm):
    check_rms_norm(shape, dtype, zero_centered, strided, 'cuda', norm)


@pytest.mark.gpu
@NORM_MODULES
@DTYPES
@pytest.mark.parametrize('strided', [False, True], ids=['contiguous', 'strided'])
@pytest.mark.parametrize('shape', NORM_SHAPES, ids=norm_id)
def test_gated_rms_norm_gpu(shape, strided, dtype, norm):
    check_gated_rms_norm(shape, dtype, strided, 'cuda', norm)


@interpreted
@NORM_MODULES
@DTYPES
@pytest.mark.parametrize('shape', NORM_SHAPES[:4], ids=norm_id)
def test_cpu_rms_norm(shape, dtype, norm):
    check_rms_norm(shape, dtype, zero_centered=shape[0] % 2 == 1, strided=True, device='cpu', norm=norm)
    check_gated_rms_norm(shape, dtype, strided=shape[0] % 2 == 0, device='cpu', norm=norm)


# ------------------------------------------------------------------------------------------------------ rotary


@dataclass
class RotaryCase:
    num_tokens: int
    num_q_heads: int
    num_k_heads: int
    head_dim: int
    rotary_dim: int

    def __str__(self) -> str:
        return (f'T{self.num_tokens}-Hq{self.num_q_heads}-Hk{self.num_k_heads}-D{self.head_dim}'
                f'-R{self.rotary_dim}')


ROTARY_CASES = [RotaryCase(1, 2, 1, 8, 8), RotaryCase(5, 4, 2, 32, 16), RotaryCase(7, 3, 1, 64, 64),
                RotaryCase(0, 2, 2, 16, 16), RotaryCase(3, 2, 2, 256, 64), RotaryCase(9, 16, 2, 128, 128)]


def check_rotary(case: RotaryCase, dtype, fused_qkv: bool, device: str) -> None:
    """`fused_qkv` takes q and k as head views of one packed qkv projection (strided tokens)."""
    gen = torch.Generator().manual_seed(2)
    t, hq, hk, d = case.num_tokens, case.num_q_heads, case.num_k_heads, case.head_dim
    qkv = randn(t, (hq + 2 * hk) * d, gen=gen, dtype=dtype)
    q, k = qkv[:, :hq * d].view(t, hq, d), qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
    pos = torch.randint(0, 4096, (t,), generator=gen).float()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, case.rotary_dim, 2).float() / case.rotary_dim))
    emb = torch.cat([pos[:, None] * inv_freq] * 2, dim=-1)
    cos, sin = emb.cos(), emb.sin()
    ref_q, ref_k = ref_elementwise.apply_rotary(q, k, cos, sin)
    qkv_dev = qkv.to(device)
    if fused_qkv:
        q_dev, k_dev = qkv_dev[:, :hq * d].view(t, hq, d), qkv_dev[:, hq * d:(hq + hk) * d].view(t, hk, d)
    else:
        q_dev, k_dev = q.contiguous().to(device), k.contiguous().to(device)
    out_q, out_k = cuda_rotary.apply_rotary(q_dev, k_dev, cos.to(device), sin.to(device))
    assert out_q.dtype == out_k.dtype == dtype
    assert_close(out_q, ref_q, what='q', **tol(dtype, fp32=1e-5))
    assert_close(out_k, ref_k, what='k', **tol(dtype, fp32=1e-5))
    torch.testing.assert_close(qkv_dev.cpu(), qkv, rtol=0, atol=0)  # inputs untouched


@pytest.mark.gpu
@DTYPES
@pytest.mark.parametrize('fused_qkv', [False, True], ids=['contiguous', 'qkv_views'])
@pytest.mark.parametrize('case', ROTARY_CASES, ids=str)
def test_rotary_gpu(case, fused_qkv, dtype):
    check_rotary(case, dtype, fused_qkv, 'cuda')


@interpreted
@DTYPES
@pytest.mark.parametrize('case', ROTARY_CASES[:5], ids=str)
def test_cpu_rotary(case, dtype):
    check_rotary(case, dtype, fused_qkv=case.num_tokens % 2 == 1, device='cpu')


# ------------------------------------------------------------------------------------------------------ MoE


@dataclass
class MoeCase:
    num_tokens: int
    hidden: int
    inter: int
    num_experts: int
    top_k: int
    skewed: bool = False  # route every token to the first top_k experts (several row blocks per expert)

    def __str__(self) -> str:
        skew = '-skewed' if self.skewed else ''
        return f'T{self.num_tokens}-H{self.hidden}-I{self.inter}-E{self.num_experts}-K{self.top_k}{skew}'


MOE_CASES = [MoeCase(1, 32, 16, 4, 2), MoeCase(5, 48, 40, 6, 2), MoeCase(0, 32, 16, 4, 2),
             MoeCase(40, 32, 24, 8, 2, skewed=True), MoeCase(33, 64, 96, 8, 3),
             MoeCase(300, 256, 192, 16, 4), MoeCase(130, 136, 72, 64, 8)]
MOE_CASES_LARGE = [MoeCase(3, 2048, 512, 128, 8), MoeCase(200, 2048, 512, 128, 8)]  # decode / prefill, GPU only


def check_moe(case: MoeCase, dtype, device: str, config: cuda_moe.MoeConfig | None = None,
              with_shared: bool = False, gated: bool = False) -> None:
    """`with_shared`: one more column naming a shared expert (id E, its own weights, a sigmoid-like scale), run in
    the same launches; the reference computes it on its own (`backends/default/moe.fused_moe(shared=...)`).
    `gated`: a shared expert's output and gate logit (a column of a wider tensor, as the stacked projection's
    is) added by the op (`gated_shared`), against the reference's torch ops."""
    gen = torch.Generator().manual_seed(6)
    t, e, k = case.num_tokens, case.num_experts, case.top_k
    x = randn(t, case.hidden, gen=gen, dtype=dtype)
    gate_up = (randn(e, 2 * case.inter, case.hidden, gen=gen) / case.hidden ** 0.5).to(dtype)
    down = (randn(e, case.hidden, case.inter, gen=gen) / case.inter ** 0.5).to(dtype)
    if case.skewed:
        ids = torch.arange(k).repeat(t, 1)
    else:
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]) if t else torch.zeros(0, k)
    ids = ids.to(torch.int64)
    weights = torch.rand(t, k, generator=gen).softmax(-1).to(dtype)
    shared, ref_shared = None, None
    if with_shared:
        shared = ((randn(2 * case.inter, case.hidden, gen=gen) / case.hidden ** 0.5).to(dtype),
                  (randn(case.hidden, case.inter, gen=gen) / case.inter ** 0.5).to(dtype))
        ref_shared = tuple(w.float() for w in shared)
        ids = torch.cat([ids, torch.full((t, 1), e, dtype=torch.int64)], dim=1)
        weights = torch.cat([weights, torch.rand(t, 1, generator=gen).to(dtype)], dim=1)
    gated_shared, ref_gated = None, None
    if gated:
        shared_out = randn(t, case.hidden, gen=gen, dtype=dtype)
        logit = randn(t, 3, gen=gen, dtype=dtype)[:, 1:2] * 4
        gated_shared, ref_gated = (shared_out, logit), (shared_out.float(), logit.float())
    ref = ref_fused_moe(x.float(), gate_up.float(), down.float(), weights.float(), ids, shared=ref_shared,
                        gated_shared=ref_gated)
    out = cuda_moe.fused_moe(x.to(device), gate_up.to(device), down.to(device), weights.to(device), ids.to(device),
                             config, shared=None if shared is None else tuple(w.to(device) for w in shared),
                             gated_shared=None if gated_shared is None else tuple(w.to(device) for w in gated_shared))
    assert out.shape == x.shape and out.dtype == dtype
    assert_close(out, ref, what='moe', **tol(dtype, fp32=1e-4, bf16=3e-2))


@pytest.mark.gpu
@DTYPES
@pytest.mark.parametrize('case', MOE_CASES + MOE_CASES_LARGE, ids=str)
def test_fused_moe_gpu(case, dtype):
    check_moe(case, dtype, 'cuda')


@interpreted
@pytest.mark.parametrize('case', MOE_CASES[:4], ids=str)
def test_cpu_fused_moe(case):
    check_moe(case, torch.float32, 'cpu')


# tile configs of the tuned tables' kind: row blocks larger than an expert's rows, K tiles past the hidden size
MOE_CONFIGS = [cuda_moe.MoeConfig(32, (16, 128, 4, 3), (32, 16, 2, 4)), cuda_moe.MoeConfig(16, (32, 16, 1, 2),
                                                                                            (16, 64, 4, 3))]


# the expert GEMMs' program order (`moe.cols_first`, LMDEPLOY_MOE_COLS_FIRST): the same result either way
MOE_ORDERS = pytest.mark.parametrize('cols_first', [False, True], ids=['rows-first', 'cols-first'])


@interpreted
@MOE_ORDERS
@pytest.mark.parametrize('config', MOE_CONFIGS, ids=lambda c: f'M{c.block_m}-up{c.up[0]}x{c.up[1]}')
@pytest.mark.parametrize('case', [MOE_CASES[1], MOE_CASES[3]], ids=str)
def test_cpu_fused_moe_tile_configs(case, config, cols_first, monkeypatch):
    monkeypatch.setattr(cuda_moe, '_COLS_FIRST_MODE', '1' if cols_first else '0')
    check_moe(case, torch.float32, 'cpu', config)
    if cols_first:
        check_moe(case, torch.float32, 'cpu', config, with_shared=True)


@pytest.mark.gpu
@MOE_ORDERS
@pytest.mark.parametrize('config', MOE_CONFIGS, ids=lambda c: f'M{c.block_m}-up{c.up[0]}x{c.up[1]}')
@pytest.mark.parametrize('case', MOE_CASES_LARGE, ids=str)
def test_fused_moe_tile_configs_gpu(case, config, cols_first, monkeypatch):
    monkeypatch.setattr(cuda_moe, '_COLS_FIRST_MODE', '1' if cols_first else '0')
    check_moe(case, torch.bfloat16, 'cuda', config)
    check_moe(case, torch.bfloat16, 'cuda', None, with_shared=True)  # the table's tiles for this device


@interpreted
@pytest.mark.parametrize('case', [MOE_CASES[0], MOE_CASES[1], MOE_CASES[3]], ids=str)
def test_cpu_fused_moe_with_a_shared_expert(case):
    check_moe(case, torch.float32, 'cpu', with_shared=True)
    check_moe(case, torch.float32, 'cpu', MOE_CONFIGS[1], with_shared=True)


@pytest.mark.gpu
@DTYPES
@pytest.mark.parametrize('case', MOE_CASES + MOE_CASES_LARGE, ids=str)
def test_fused_moe_with_a_shared_expert_gpu(case, dtype):
    check_moe(case, dtype, 'cuda', with_shared=True)


@interpreted
@pytest.mark.parametrize('combine', [False, True], ids=['torch-add', 'combine-launch'])
@pytest.mark.parametrize('case', [MOE_CASES[0], MOE_CASES[1], MOE_CASES[3]], ids=str)
def test_cpu_fused_moe_adds_a_gated_shared_output(case, combine, monkeypatch):
    monkeypatch.setattr(cuda_moe, '_COMBINE', combine)                  # LMDEPLOY_MOE_COMBINE
    check_moe(case, torch.float32, 'cpu', gated=True)                   # few tokens: the GEMV path, torch add
    check_moe(case, torch.float32, 'cpu', MOE_CONFIGS[1], gated=True)   # the GEMM path


@pytest.mark.gpu
@DTYPES
@pytest.mark.parametrize('combine', [False, True], ids=['torch-add', 'combine-launch'])
@pytest.mark.parametrize('case', MOE_CASES + MOE_CASES_LARGE, ids=str)
def test_fused_moe_adds_a_gated_shared_output_gpu(case, dtype, combine, monkeypatch):
    monkeypatch.setattr(cuda_moe, '_COMBINE', combine)
    check_moe(case, dtype, 'cuda', gated=True)


# ------------------------------------------------------------------------------------------------ interpreter


@pytest.mark.skipif(INTERPRET, reason='already running under the interpreter')
def test_triton_kernels_interpreted():
    """Run the `test_cpu_*` tests in a subprocess with TRITON_INTERPRET=1 (set before Triton is imported)."""
    run_cpu_tests_interpreted(__file__)
