"""A decoder layer's norms run with the projection after them (`RMSNorm.linear`, `OpType.RMSNormLinear`; the `cuda`
backend's one-row kernel: tests/kernels/test_norm_gemv_kernel.py): the MLPs' and MoE blocks' `forward_normed` must
give what the norm followed by the plain forward gives, bit for bit on the default backend (whose op is the two ops
in sequence), return the residual stream x + residual, and call the fused op exactly once where the projection is a
plain weight (none where LoRA or FP8 make it run alone); a MoE block whose shared expert folds into the experts' op
runs its norm and routing as one op instead (`TopKRouter.norm_route`, `OpType.NormRoute`). Whole-model parity
through these paths: the reference tests (tests/models/test_hybrid_models.py, tests/models/test_qwen3_reference.py)
on CPU and the engine's gpu tests.
"""
from __future__ import annotations

import pytest
import torch
from test_moe_shared_fold import make_block

from lmdeploy.pytorch.nn import moe as nn_moe
from lmdeploy.pytorch.nn.activation import GatedMLP
from lmdeploy.pytorch.nn.norm import RMSNorm


def counted_norm(hidden: int, dtype: torch.dtype) -> tuple[RMSNorm, list]:
    norm = RMSNorm(hidden, 1e-6, zero_centered=True)
    norm.weight.data = (0.1 * torch.randn(hidden, generator=torch.Generator().manual_seed(5))).to(dtype)
    calls, impl = [], norm._linear_impl
    norm._linear_impl = lambda *a, **kw: calls.append(a[5].shape) or impl(*a, **kw)
    return norm, calls


def inputs(tokens: int, hidden: int, dtype: torch.dtype, first: bool):
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    return x, None if first else torch.randn(tokens, hidden, generator=gen).to(dtype)


def expected(norm: RMSNorm, x, residual, forward):
    h, s = (norm(x), x) if residual is None else norm(x, residual)
    return forward(h), s


@pytest.mark.parametrize('first', [False, True], ids=['residual', 'first'])
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16], ids=['fp32', 'bf16'])
def test_mlp_forward_normed(dtype, first):
    mlp = GatedMLP(32, 24)
    for p in mlp.parameters():
        p.data = torch.randn(p.shape, generator=torch.Generator().manual_seed(1)).to(dtype) / 6
    norm, calls = counted_norm(32, dtype)
    x, residual = inputs(3, 32, dtype, first)
    out, s = mlp.forward_normed(x, residual, norm)
    want, want_s = expected(norm, x, residual, mlp)
    assert calls == [mlp.gate_up_proj.weight.shape]
    assert torch.equal(out, want) and torch.equal(s, want_s)
    if first:
        assert s is x
    calls.clear()
    mlp.gate_up_proj.lora = lambda h, y: y + 1.0   # an adapter: the projection runs alone on the normed row
    out, s = mlp.forward_normed(x, residual, norm)
    assert calls == [] and torch.equal(out, expected(norm, x, residual, mlp)[0])


@pytest.mark.parametrize('fold', [False, True], ids=['separate-shared', 'folded-shared'])
@pytest.mark.parametrize('tokens', [1, 5])
def test_moe_forward_normed(monkeypatch, fold, tokens):
    monkeypatch.setattr(nn_moe, '_FOLD_SHARED', fold)
    block = make_block(torch.bfloat16)
    assert block.fuse_input_projections()
    norm, calls = counted_norm(32, torch.bfloat16)
    route_calls, route_impl = [], block.gate._norm_route_impl
    block.gate._norm_route_impl = lambda *a, **kw: route_calls.append((a[5].shape, a[8])) or route_impl(*a, **kw)
    x, residual = inputs(tokens, 32, torch.bfloat16, first=False)
    routes, want_routes = (torch.empty(tokens, 2, dtype=torch.int32) for _ in range(2))
    out, s = block.forward_normed(x, residual, norm, routes)
    want, want_s = expected(norm, x, residual, lambda h: block(h, want_routes))
    if fold:   # the norm, the router's and shared gate's rows and the routing as one op
        assert calls == [] and route_calls == [((block.gate.weight.shape[0] + 1, 32), True)]
    else:      # the norm with the whole stack
        assert calls == [(block._fused_in.shape[0], 32)] and route_calls == []
    assert torch.equal(out, want) and torch.equal(s, want_s) and torch.equal(routes, want_routes)


def test_moe_forward_normed_without_stacked_projections(monkeypatch):
    monkeypatch.setattr(nn_moe, '_FOLD_SHARED', False)
    block = make_block(torch.float32)                  # not fused: the norm runs alone, then the block
    norm, calls = counted_norm(32, torch.float32)
    x, residual = inputs(4, 32, torch.float32, first=False)
    out, s = block.forward_normed(x, residual, norm)
    want, want_s = expected(norm, x, residual, block)
    assert calls == [] and torch.equal(out, want) and torch.equal(s, want_s)
