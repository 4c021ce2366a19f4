"""The few-token fused MoE (`kernels/cuda/moe_gemv.py`) against the default backend's `fused_moe` in float32 (the
torch reference of `tests/kernels/test_cuda_kernels_ops.py`'s MoE checks), and `moe.fused_moe`'s dispatch to
it (on unless `LMDEPLOY_MOE_GEMV=0`: up to `MAX_TOKENS` tokens, no explicit tile config).

Shapes on purpose: hidden and intermediate widths that leave a masked tail of the 512-column step or are smaller
than one step, rows not a multiple of `BLOCK_N`, top-1 and top-8, tokens that share an expert, a shared expert as
id E, and a token row stride wider than the hidden size. `test_cpu_*` run under the Triton interpreter in the
subprocess `test_moe_gemv_kernel_interpreted` starts; `@pytest.mark.gpu` tests run on CUDA, one inside a graph.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from interpreted import run_cpu_tests_interpreted
from kernel_inputs import randn, strided_copy, tol
from numeric import assert_close

from lmdeploy.pytorch.backends.default.moe import fused_moe as ref_fused_moe
from lmdeploy.pytorch.kernels.cuda import moe as cuda_moe
from lmdeploy.pytorch.kernels.cuda.gemv import gemv_config
from lmdeploy.pytorch.kernels.cuda.moe_gemv import MAX_TOKENS, default_tiles, fused_moe_gemv

INTERPRET = os.environ.get('TRITON_INTERPRET') == '1'
interpreted = pytest.mark.skipif(not INTERPRET, reason='runs inside test_moe_gemv_kernel_interpreted')


@dataclass
class Case:
    tokens: int
    hidden: int
    inter: int
    experts: int
    top_k: int
    shared: bool = False
    same_experts: bool = False  # every token routed to the same experts (pairs of one expert in several programs)

    def __str__(self) -> str:
        extra = ('-shared' if self.shared else '') + ('-same' if self.same_experts else '')
        return f'T{self.tokens}-H{self.hidden}-I{self.inter}-E{self.experts}-K{self.top_k}{extra}'


# (interpreted: a case costs its programs, which the H200's 132-SM tile rule makes many for wide rows)
CPU_CASES = [Case(1, 32, 16, 4, 2), Case(3, 48, 40, 6, 2, same_experts=True), Case(1, 600, 24, 8, 2, shared=True),
             Case(1, 40, 530, 5, 1), Case(0, 32, 16, 4, 2)]
GPU_CASES = CPU_CASES + [Case(4, 600, 24, 8, 3, shared=True), Case(2, 40, 520, 5, 1), Case(1, 2048, 512, 64, 8),
                         Case(4, 2048, 512, 64, 10, shared=True), Case(2, 4096, 1536, 32, 8, same_experts=True)]


def make_inputs(case: Case, dtype: torch.dtype, gen: torch.Generator):
    t, e, k = case.tokens, case.experts, case.top_k
    x = randn(t, case.hidden, gen=gen, dtype=dtype)
    gate_up = (randn(e, 2 * case.inter, case.hidden, gen=gen) / case.hidden ** 0.5).to(dtype)
    down = (randn(e, case.hidden, case.inter, gen=gen) / case.inter ** 0.5).to(dtype)
    if case.same_experts:
        ids = torch.randperm(e, generator=gen)[:k].repeat(t, 1)
    else:
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]) if t else torch.zeros(0, k)
    ids = ids.to(torch.int64)
    weights = torch.rand(t, k, generator=gen).softmax(-1).to(dtype)
    shared = None
    if case.shared:
        shared = ((randn(2 * case.inter, case.hidden, gen=gen) / case.hidden ** 0.5).to(dtype),
                  (randn(case.hidden, case.inter, gen=gen) / case.inter ** 0.5).to(dtype))
        ids = torch.cat([ids, torch.full((t, 1), e, dtype=torch.int64)], dim=1)
        weights = torch.cat([weights, torch.rand(t, 1, generator=gen).to(dtype)], dim=1)
    return x, gate_up, down, weights, ids, shared


def reference(x, gate_up, down, weights, ids, shared) -> torch.Tensor:
    return ref_fused_moe(x.float(), gate_up.float(), down.float(), weights.float(), ids,
                         shared=None if shared is None else tuple(w.float() for w in shared))


# a benchmark's explicit tiles: masked tails in both dims, 8 warps, the down launch's top-k loop unrolled
SWEPT_TILES = dict(up=dict(BLOCK_N=4, BLOCK_K=32, num_warps=8), down=dict(BLOCK_N=8, BLOCK_K=16, num_warps=4, UNROLL=3))


def check(case: Case, dtype: torch.dtype, device: str, strided: bool = False, config: dict | None = None) -> None:
    gen = torch.Generator().manual_seed(case.tokens * 31 + case.hidden)
    x, gate_up, down, weights, ids, shared = make_inputs(case, dtype, gen)
    ref = reference(x, gate_up, down, weights, ids, shared)
    x_dev = strided_copy(x.to(device)) if strided else x.to(device)  # rows of a wider, NaN-padded buffer
    out = fused_moe_gemv(x_dev, gate_up.to(device), down.to(device), weights.to(device), ids.to(device),
                         None if shared is None else tuple(w.to(device) for w in shared), config)
    assert out.shape == x.shape and out.dtype == dtype
    assert_close(out.cpu(), ref, what=f'moe gemv {case}', **tol(dtype, fp32=1e-4, bf16=3e-2))


@interpreted
@pytest.mark.parametrize('case', CPU_CASES, ids=str)
def test_cpu_moe_gemv_matches_reference(case):
    check(case, torch.float32, 'cpu')


@interpreted
def test_cpu_moe_gemv_half_and_strided_rows():
    check(CPU_CASES[1], torch.bfloat16, 'cpu', strided=True)
    check(CPU_CASES[0], torch.float16, 'cpu')
    check(Case(2, 40, 20, 6, 3, shared=True), torch.float32, 'cpu', config=SWEPT_TILES)
    check(CPU_CASES[1], torch.bfloat16, 'cpu', config=SWEPT_TILES)


@interpreted
def test_cpu_fused_moe_dispatches_few_tokens_only(monkeypatch):
    import lmdeploy.pytorch.kernels.cuda.moe_gemv as moe_gemv
    calls = []
    monkeypatch.setattr(cuda_moe, '_MOE_GEMV', True)
    monkeypatch.setattr(moe_gemv, 'fused_moe_gemv', lambda *a: calls.append(a[0].shape[0]) or fused_moe_gemv(*a))
    gen = torch.Generator().manual_seed(3)
    for tokens, config, used in ((1, None, True), (MAX_TOKENS, None, True), (MAX_TOKENS + 1, None, False),
                                 (2, cuda_moe.default_config(4, 4), False)):
        calls.clear()
        x, gate_up, down, weights, ids, shared = make_inputs(Case(tokens, 32, 16, 4, 2), torch.float32, gen)
        out = cuda_moe.fused_moe(x, gate_up, down, weights, ids, config)
        assert bool(calls) == used, (tokens, config)
        assert_close(out, reference(x, gate_up, down, weights, ids, shared), what='dispatch', atol=1e-4, rtol=1e-4)
    monkeypatch.setattr(cuda_moe, '_MOE_GEMV', False)
    calls.clear()
    x, gate_up, down, weights, ids, _ = make_inputs(Case(1, 32, 16, 4, 2), torch.float32, gen)
    cuda_moe.fused_moe(x, gate_up, down, weights, ids)
    assert not calls, 'LMDEPLOY_MOE_GEMV off: fused_moe must keep its own launches'


def test_moe_gemv_kernel_interpreted():
    run_cpu_tests_interpreted(__file__)


def test_default_tiles_follow_the_sweep_and_ignore_the_token_count():
    """The H200 sweep's best tiles for the 35B-A3B experts (H 2048, I 512, top-8): up one gate row (and its up row)
    a program in 512-column steps, as `gemv_config` tiles the pairs' stacked rows; down 8 rows, 128-column steps,
    8 warps, the top-k loop unrolled. Only the shape enters, never the token count."""
    assert default_tiles(8, 2048, 512, 132) == dict(up=dict(BLOCK_N=1, BLOCK_K=512, num_warps=4),
                                                    down=dict(BLOCK_N=8, BLOCK_K=128, num_warps=8, UNROLL=8))
    assert default_tiles(11, 2048, 512, 132)['down']['UNROLL'] == 11       # top-10 plus a folded shared expert
    assert default_tiles(8, 40, 24, 132)['down']['BLOCK_K'] == 32          # an intermediate under one step
    assert default_tiles(8, 4096, 1536, 132)['up'] == gemv_config(8 * 1536, 4096, 132)


@pytest.mark.gpu
@pytest.mark.parametrize('case', GPU_CASES, ids=str)
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16, torch.float32], ids=['bf16', 'fp16', 'fp32'])
def test_moe_gemv_matches_reference_gpu(case, dtype):
    check(case, dtype, 'cuda', strided=case.tokens == 3)


@pytest.mark.gpu
@pytest.mark.parametrize('case', GPU_CASES[-4:], ids=str)
def test_moe_gemv_swept_tiles_match_reference_gpu(case):
    check(case, torch.bfloat16, 'cuda', config=SWEPT_TILES)


@pytest.mark.gpu
def test_moe_gemv_replays_in_cuda_graph_gpu():
    gen = torch.Generator().manual_seed(5)
    case = Case(1, 2048, 512, 64, 8)
    x, gate_up, down, weights, ids, _ = (t.cuda() if t is not None else t
                                         for t in make_inputs(case, torch.bfloat16, gen))
    fused_moe_gemv(x, gate_up, down, weights, ids)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_gemv(x, gate_up, down, weights, ids)
    x.copy_(torch.randn_like(x))
    ids.copy_(torch.randperm(64, device='cuda')[:8][None])
    graph.replay()
    ref = reference(x.cpu(), gate_up.cpu(), down.cpu(), weights.cpu(), ids.cpu(), None)
    assert_close(out.cpu(), ref, what='moe gemv in a graph', **tol(torch.bfloat16, fp32=1e-4, bf16=3e-2))
