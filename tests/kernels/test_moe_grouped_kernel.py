"""The grouped-GEMM MoE path (`kernels/cuda/moe_grouped.py`: torch's grouped GEMM between a sort, a gather and the
Triton un-permute) against the default backend's `fused_moe` in float32, and `moe.fused_moe`'s dispatch to it
(``LMDEPLOY_MOE_GROUPED_MM=<tokens>``: forwards of at least that many tokens, no explicit tiles, no shared expert
run as an expert, experts it supports).

Shapes on purpose: experts that get no rows (empty groups), every token on the same experts (one large group),
top-1, a hidden width past one 1024-column block of the un-permute (masked tail), a token row stride wider than the
hidden size, and token counts not a multiple of anything. `test_cpu_*` run under the Triton interpreter in the
subprocess `test_moe_grouped_kernel_interpreted` starts (torch's grouped GEMM has a CPU kernel); `@pytest.mark.gpu`
tests run on CUDA, one inside a graph replayed with new routing.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from interpreted import run_cpu_tests_interpreted
from kernel_inputs import randn, strided_copy
from numeric import assert_close

from lmdeploy.pytorch.backends.default.moe import fused_moe as ref_fused_moe
from lmdeploy.pytorch.kernels.cuda import moe as cuda_moe
from lmdeploy.pytorch.kernels.cuda import moe_grouped

INTERPRET = os.environ.get('TRITON_INTERPRET') == '1'
interpreted = pytest.mark.skipif(not INTERPRET, reason='runs inside test_moe_grouped_kernel_interpreted')
TOL = dict(atol=3e-2, rtol=3e-2)


@dataclass
class Case:
    tokens: int
    hidden: int
    inter: int
    experts: int
    top_k: int
    same_experts: bool = False

    def __str__(self) -> str:
        return f'T{self.tokens}-H{self.hidden}-I{self.inter}-E{self.experts}-K{self.top_k}' + \
            ('-same' if self.same_experts else '')


CPU_CASES = [Case(7, 48, 24, 6, 3), Case(5, 32, 16, 8, 2, same_experts=True), Case(9, 1040, 16, 4, 1),
             Case(3, 64, 40, 16, 4)]
GPU_CASES = CPU_CASES + [Case(1024, 2048, 512, 64, 8), Case(333, 2048, 512, 64, 10), Case(200, 4096, 1536, 32, 8),
                         Case(64, 2048, 512, 64, 8, same_experts=True)]


def make_inputs(case: Case, gen: torch.Generator, dtype=torch.bfloat16):
    t, e, k = case.tokens, case.experts, case.top_k
    x = randn(t, case.hidden, gen=gen, dtype=dtype)
    gate_up = (randn(e, 2 * case.inter, case.hidden, gen=gen) / case.hidden ** 0.5).to(dtype)
    down = (randn(e, case.hidden, case.inter, gen=gen) / case.inter ** 0.5).to(dtype)
    if case.same_experts:
        ids = torch.randperm(e, generator=gen)[:k].repeat(t, 1)
    else:
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=gen).softmax(-1).to(dtype)
    return x, gate_up, down, weights, ids.to(torch.int64)


def reference(x, gate_up, down, weights, ids, gated_shared=None) -> torch.Tensor:
    shared = None if gated_shared is None else tuple(t.float() for t in gated_shared)
    return ref_fused_moe(x.float(), gate_up.float(), down.float(), weights.float(), ids, gated_shared=shared)


def check(case: Case, device: str, strided: bool = False) -> None:
    gen = torch.Generator().manual_seed(case.tokens * 31 + case.hidden)
    x, gate_up, down, weights, ids = make_inputs(case, gen)
    ref = reference(x, gate_up, down, weights, ids)
    x_dev = strided_copy(x.to(device), pad=8) if strided else x.to(device)
    gate_up, down = gate_up.to(device), down.to(device)
    assert moe_grouped.supported(x_dev, gate_up, down)
    per_pair = moe_grouped.per_pair_outputs(x_dev, gate_up, down, weights.to(device), ids.to(device))
    assert per_pair.shape == (case.tokens * case.top_k, case.hidden) and per_pair.dtype == torch.bfloat16
    out = per_pair.view(case.tokens, case.top_k, case.hidden).float().sum(1)
    assert_close(out.cpu(), ref, what=f'grouped moe {case}', **TOL)


@interpreted
@pytest.mark.parametrize('case', CPU_CASES, ids=str)
def test_cpu_grouped_moe_matches_reference(case):
    check(case, 'cpu', strided=case.tokens == 3)


@interpreted
def test_cpu_sort_pairs_groups_by_expert_stably():
    ids = torch.tensor([[2, 0], [0, 3], [2, 1], [0, 2]])
    order, offs = moe_grouped.sort_pairs(ids, 5)
    assert order.tolist() == [1, 2, 6, 5, 0, 4, 7, 3]     # expert 0: pairs 1, 2, 6; 1: 5; 2: 0, 4, 7; 3: 3
    assert offs.dtype == torch.int32 and offs.tolist() == [3, 4, 7, 8, 8]   # expert 4: an empty group


@interpreted
def test_cpu_fused_moe_dispatches_from_the_threshold(monkeypatch):
    calls = []
    real = moe_grouped.per_pair_outputs
    monkeypatch.setattr(moe_grouped, 'per_pair_outputs', lambda *a: calls.append(a[0].shape[0]) or real(*a))
    monkeypatch.setattr(cuda_moe, '_GROUPED_FROM', 20)
    gen = torch.Generator().manual_seed(4)
    for tokens, config, used in ((20, None, True), (31, None, True), (19, None, False),
                                 (24, cuda_moe.default_config(48, 8), False)):
        calls.clear()
        x, gate_up, down, weights, ids = make_inputs(Case(tokens, 32, 16, 8, 2), gen)
        gated = (randn(tokens, 32, gen=gen, dtype=torch.bfloat16), randn(tokens, 1, gen=gen, dtype=torch.bfloat16))
        out = cuda_moe.fused_moe(x, gate_up, down, weights, ids, config, gated_shared=gated)
        assert bool(calls) == used, (tokens, config)
        assert out.shape == x.shape and out.dtype == torch.bfloat16
        if used:   # (the Triton kernels' bf16 tiles are checked on CUDA: the interpreter's bf16 dot is not theirs)
            assert_close(out.float(), reference(x, gate_up, down, weights, ids, gated), what='dispatch', **TOL)
    calls.clear()    # float32 experts: not supported, the Triton kernels run
    x, gate_up, down, weights, ids = make_inputs(Case(24, 32, 16, 8, 2), gen, dtype=torch.float32)
    cuda_moe.fused_moe(x, gate_up, down, weights, ids)
    assert not calls
    monkeypatch.setattr(cuda_moe, '_GROUPED_FROM', 0)    # the default: off
    x, gate_up, down, weights, ids = make_inputs(Case(40, 32, 16, 8, 2), gen)
    cuda_moe.fused_moe(x, gate_up, down, weights, ids)
    assert not calls


def test_moe_grouped_kernel_interpreted():
    run_cpu_tests_interpreted(__file__)


def test_supported_needs_bf16_contiguous_16_byte_rows():
    gen = torch.Generator().manual_seed(1)
    x, gate_up, down, _, _ = make_inputs(Case(4, 32, 16, 4, 2), gen)
    assert moe_grouped.supported(x, gate_up, down) == (moe_grouped._GROUPED_MM is not None)
    assert not moe_grouped.supported(x.float(), gate_up.float(), down.float())
    assert not moe_grouped.supported(x, gate_up.transpose(1, 2).contiguous().transpose(1, 2), down)
    x, gate_up, down, _, _ = make_inputs(Case(4, 32, 20, 4, 2), gen)     # 40-byte intermediate rows
    assert not moe_grouped.supported(x, gate_up, down)


@pytest.mark.parametrize('raw, want', [(None, 0), ('', 0), ('0', 0), ('512', 512)])
def test_min_tokens_reads_the_environment(monkeypatch, raw, want):
    if raw is None:
        monkeypatch.delenv('LMDEPLOY_MOE_GROUPED_MM', raising=False)
    else:
        monkeypatch.setenv('LMDEPLOY_MOE_GROUPED_MM', raw)
    assert moe_grouped.min_tokens() == want


@pytest.mark.parametrize('raw', ['on', '-1', '1.5'])
def test_min_tokens_refuses_what_is_not_a_count(monkeypatch, raw):
    monkeypatch.setenv('LMDEPLOY_MOE_GROUPED_MM', raw)
    with pytest.raises(ValueError, match='LMDEPLOY_MOE_GROUPED_MM'):
        moe_grouped.min_tokens()


gpu_grouped = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                 reason='grouped GEMM path: CUDA compute capability 9+')


@pytest.mark.gpu
@gpu_grouped
@pytest.mark.parametrize('case', GPU_CASES, ids=str)
def test_grouped_moe_matches_reference_gpu(case):
    check(case, 'cuda', strided=case.tokens == 333)


@pytest.mark.gpu
@gpu_grouped
def test_grouped_moe_agrees_with_the_triton_kernels_gpu():
    gen = torch.Generator().manual_seed(6)
    case = Case(1024, 2048, 512, 64, 8)
    x, gate_up, down, weights, ids = (t.cuda() for t in make_inputs(case, gen))
    triton_out = cuda_moe.fused_moe(x, gate_up, down, weights, ids, cuda_moe.default_config(8192, 64))
    grouped = moe_grouped.per_pair_outputs(x, gate_up, down, weights, ids).view(1024, 8, 2048).float().sum(1)
    assert_close(grouped, triton_out.float(), what='grouped vs Triton', **TOL)


@pytest.mark.gpu
@gpu_grouped
def test_grouped_moe_replays_in_cuda_graph_gpu():
    gen = torch.Generator().manual_seed(5)
    case = Case(256, 2048, 512, 64, 8)
    x, gate_up, down, weights, ids = (t.cuda() for t in make_inputs(case, gen))
    moe_grouped.per_pair_outputs(x, gate_up, down, weights, ids)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_grouped.per_pair_outputs(x, gate_up, down, weights, ids)
    x.copy_(torch.randn_like(x))
    ids.copy_(torch.rand(256, 64, device='cuda').topk(8, dim=-1).indices)
    graph.replay()
    ref = reference(x.cpu(), gate_up.cpu(), down.cpu(), weights.cpu(), ids.cpu())
    assert_close(out.view(256, 8, 2048).float().sum(1).cpu(), ref, what='grouped moe in a graph', **TOL)
