"""A MoE layer's norm, router GEMV and routing in one launch (`kernels/cuda/moe_routing.norm_route`) against a float64
reference of the three ops, and the `cuda` backend's `OpType.NormRoute` dispatch to it (up to the few-token MoE's
tokens, with `LMDEPLOY_NORM_ROUTE=1`: opt-in).

Reference: s = x + residual rounded to the dtype (the residual stream: bit-exact), h = s * rsqrt(mean(s^2) + eps) *
w' in float64 (w' = 1 + w when zero-centred; the kernel's h within one rounding), the logits F.linear(h, rows) in
float64 from the kernel's own h, their float64 softmax, and the top-k of it. The kernel rounds its float32 logits to
the dtype as the unfused GEMV does, so in half precision near-equal logits may tie or swap: each chosen expert must
be among the reference's top-k up to that rounding (its probability at least the reference's k-th largest less the
tolerance), distinct, in descending order, with its weight within the tolerance of the reference's (renormalised
over the chosen ones); in float32 the ids must equal the reference's. The shared column is id E with weight
sigmoid(logit). Shapes on purpose: a program per router row, so the last program's routing reads the others' logits,
a width and an expert count that are no powers of two, top-1, no shared row, no residual (the first layer: s is x
itself), several tokens, rows that are a slice of a wider stacked projection, and repeated launches (the arrival
counters go back to zero, in a CUDA graph too). `test_cpu_*` run under the Triton interpreter in the subprocess
`test_norm_route_kernel_interpreted` starts; `@pytest.mark.gpu` tests run on CUDA.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from interpreted import run_cpu_tests_interpreted

from lmdeploy.pytorch.kernels.cuda.moe_routing import norm_route

INTERPRET = os.environ.get('TRITON_INTERPRET') == '1'
interpreted = pytest.mark.skipif(not INTERPRET, reason='runs inside test_norm_route_kernel_interpreted')


@dataclass
class Case:
    tokens: int
    hidden: int
    experts: int
    top_k: int
    shared: bool = True
    residual: bool = True
    renormalize: bool = True

    def __str__(self) -> str:
        return (f'T{self.tokens}-H{self.hidden}-E{self.experts}-K{self.top_k}' + ('-shared' if self.shared else '')
                + ('' if self.residual else '-first') + ('' if self.renormalize else '-raw'))


CPU_CASES = [Case(1, 32, 8, 2), Case(3, 600, 10, 3, residual=False), Case(2, 48, 6, 1, shared=False),
             Case(1, 2048, 64, 8, renormalize=False), Case(4, 100, 13, 4)]
GPU_CASES = CPU_CASES + [Case(1, 2048, 64, 10), Case(4, 2048, 512, 10), Case(2, 4096, 128, 8, residual=False),
                         Case(64, 2048, 64, 8)]


def make_inputs(case: Case, dtype: torch.dtype, device: str):
    gen = torch.Generator().manual_seed(case.hidden * 7 + case.experts)
    rows = case.experts + int(case.shared)
    stack = (torch.randn(rows + 5, case.hidden, generator=gen) / case.hidden ** 0.5).to(dtype)
    x = torch.randn(case.tokens, case.hidden, generator=gen).to(dtype)
    residual = torch.randn(case.tokens, case.hidden, generator=gen).to(dtype) if case.residual else None
    norm_w = (0.1 * torch.randn(case.hidden, generator=gen)).to(dtype)

    def to(t):
        return None if t is None else t.to(device)
    return to(x), to(residual), to(norm_w), to(stack)[5:]   # the router's rows: a slice of a wider stack


def check(case: Case, dtype: torch.dtype, device: str, out=None, inputs=None) -> None:
    x, residual, norm_w, rows = inputs or make_inputs(case, dtype, device)
    eps = 1e-6
    weights, ids, s, h = out or norm_route(x, residual, norm_w, eps, True, rows, case.top_k, case.renormalize,
                                           case.shared)
    cols = case.top_k + int(case.shared)
    assert weights.shape == ids.shape == (case.tokens, cols) and weights.dtype == dtype and ids.dtype == torch.int64
    x, residual, norm_w, rows, weights, ids, s, h = (None if t is None else t.cpu()
                                                     for t in (x, residual, norm_w, rows, weights, ids, s, h))
    ref_s = x if residual is None else (x.float() + residual.float()).to(dtype)
    ulp = torch.finfo(dtype).eps
    if device == 'cpu' and dtype == torch.bfloat16:   # the interpreter truncates to bf16: within one ulp there
        assert ((s.double() - ref_s.double()).abs() <= ulp * ref_s.double().abs()).all()
    else:
        assert torch.equal(s, ref_s), 'the residual stream must be x + residual rounded once, bit-exact'
    s64 = s.double()                                   # from the stream it wrote
    ref_h = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + eps) * (norm_w.double() + 1.0)
    assert ((h.double() - ref_h).abs() <= 1.01 * ulp * ref_h.abs() + 1e-6).all(), 'normed row off'
    logits = F.linear(h.double(), rows.double())                                  # from the kernel's own h
    routed = logits[:, :case.experts]
    probs = routed.softmax(-1)
    # a logit rounded to the dtype moves the softmax by up to ~ulp * |logit| (plus the float32 dot's error)
    tol = 2 * (ulp * routed.abs().amax(-1, keepdim=True) + 1e-5) * probs.amax(-1, keepdim=True)
    chosen, chosen_w = ids[:, :case.top_k], weights[:, :case.top_k].double()
    kth = probs.topk(case.top_k, dim=-1).values[:, -1:]
    picked = probs.gather(1, chosen)
    assert (chosen >= 0).all() and (chosen < case.experts).all()
    assert all(len(set(r.tolist())) == case.top_k for r in chosen), 'ids must be distinct'
    assert (picked >= kth - tol).all(), f'{case}: an expert outside the top-k beyond rounding'
    assert (picked[:, :-1] >= picked[:, 1:] - tol).all(), 'descending order'
    want_w = picked / picked.sum(-1, keepdim=True) if case.renormalize else picked
    assert ((chosen_w - want_w).abs() <= 2 * ulp * want_w + 4 * tol + 1e-6).all(), f'{case}: weights off'
    if dtype == torch.float32:
        assert torch.equal(chosen, probs.topk(case.top_k, dim=-1).indices), 'float32: the reference top-k exactly'
    if case.shared:
        assert (ids[:, -1] == case.experts).all()
        gate = torch.sigmoid(logits[:, -1])
        assert ((weights[:, -1].double() - gate).abs() <= 2 * ulp * gate + 1e-4).all(), 'shared gate weight'


@interpreted
@pytest.mark.parametrize('case', CPU_CASES, ids=str)
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16], ids=['fp32', 'bf16'])
def test_cpu_norm_route_matches_reference(case, dtype):
    check(case, dtype, 'cpu')


@interpreted
def test_cpu_norm_route_repeats_with_counters_reset():
    """Launch after launch (different token counts, then the first again) gives the same routing: each launch's
    last program leaves its tokens' counters at zero."""
    from lmdeploy.pytorch.kernels.cuda import moe_routing
    case = Case(3, 600, 10, 3)
    inputs = make_inputs(case, torch.float32, 'cpu')
    first = norm_route(*inputs[:3], 1e-6, True, inputs[3], 3, True, True)
    norm_route(inputs[0][:1], inputs[1][:1], inputs[2], 1e-6, True, inputs[3], 3, True, True)
    again = norm_route(*inputs[:3], 1e-6, True, inputs[3], 3, True, True)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not moe_routing._route_counters(torch.device('cpu')).any()


@interpreted
def test_cpu_backend_fuses_few_tokens_only(monkeypatch):
    """With the switch on, up to the few-token MoE's tokens the backend's `OpType.NormRoute` is one launch of the
    kernel; more tokens (and every call with it off) take its norm + linear, then its routing, of the same
    semantics."""
    from lmdeploy.pytorch.backends import cuda as backend
    from lmdeploy.pytorch.backends.default.moe import norm_then_route
    calls = []
    monkeypatch.setattr(backend, '_NORM_ROUTE', True)     # opt-in (LMDEPLOY_NORM_ROUTE=1): not faster on the H100
    monkeypatch.setattr(backend, '_norm_route', lambda *a, **kw: calls.append(a[0].shape) or norm_route(*a, **kw))
    for tokens, used in ((1, True), (backend.MOE_GEMV_MAX_TOKENS, True), (backend.MOE_GEMV_MAX_TOKENS + 1, False)):
        case = Case(tokens, 48, 6, 2)
        inputs = make_inputs(case, torch.float32, 'cpu')
        calls.clear()
        out = backend.norm_route(*inputs[:3], 1e-6, True, inputs[3], 2, True, True)
        assert bool(calls) == used, tokens
        check(case, torch.float32, 'cpu', out=out, inputs=inputs)
    monkeypatch.setattr(backend, '_NORM_ROUTE', False)    # the default: the three launches
    calls.clear()
    inputs = make_inputs(Case(1, 48, 6, 2), torch.float32, 'cpu')
    check(Case(1, 48, 6, 2), torch.float32, 'cpu', out=backend.norm_route(*inputs[:3], 1e-6, True, inputs[3], 2, True,
                                                                          True), inputs=inputs)
    assert calls == []
    from lmdeploy.pytorch.backends.default import elementwise, moe
    inputs = make_inputs(Case(2, 48, 6, 2), torch.float32, 'cpu')       # the default backend's composition
    ref = norm_then_route(elementwise.rms_norm_linear, moe.softmax_topk)(*inputs[:3], 1e-6, True, inputs[3], 2,
                                                                           True, True)
    check(Case(2, 48, 6, 2), torch.float32, 'cpu', out=ref, inputs=inputs)


def test_norm_route_kernel_interpreted():
    run_cpu_tests_interpreted(__file__)


@pytest.mark.gpu
@pytest.mark.parametrize('case', GPU_CASES, ids=str)
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16, torch.float32], ids=['bf16', 'fp16', 'fp32'])
def test_norm_route_matches_reference_gpu(case, dtype):
    check(case, dtype, 'cuda')


@pytest.mark.gpu
def test_norm_route_replays_in_cuda_graph_gpu():
    case = Case(2, 2048, 64, 8)
    x, residual, norm_w, rows = make_inputs(case, torch.bfloat16, 'cuda')
    norm_route(x, residual, norm_w, 1e-6, True, rows, 8, True, True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = norm_route(x, residual, norm_w, 1e-6, True, rows, 8, True, True)
    for seed in range(3):   # each replay routes new inputs: the counters came back to zero after the last
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x))
        graph.replay()
        torch.cuda.synchronize()
        check(case, torch.bfloat16, 'cuda', out=out, inputs=(x, residual, norm_w, rows))
