"""The shared expert folded into the routed experts' op (`nn/moe.py`: `LMDEPLOY_MOE_FOLD_SHARED=1`, or the bound the
backend's op sets, CUDA's few-token MoE): on the default backend the folded block gives the unfolded
block's output and routes bit for bit (its op computes the shared expert on its own, in the same ops); with stacked
input projections the router's and shared gate's logits come from one GEMM; the fold applies only where it can
(small forwards, matching shapes, no LoRA, no FP8). The CUDA kernels running it in the routed launches:
`tests/kernels/test_cuda_kernels_ops.py`, `tests/kernels/test_moe_gemv_kernel.py`."""
from __future__ import annotations

import pytest
import torch

from lmdeploy.pytorch.nn import moe as nn_moe
from lmdeploy.pytorch.nn.activation import GatedMLP


def make_block(dtype, shared_inter: int = 24, hidden: int = 32, inter: int = 24, experts: int = 8, top_k: int = 2):
    gen = torch.Generator().manual_seed(3)
    block = nn_moe.SparseMoeBlock(hidden, experts, top_k, inter, shared_expert=GatedMLP(hidden, shared_inter))
    for p in block.parameters():
        p.data = (torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5).to(dtype)
    return block


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16], ids=['fp32', 'bf16'])
@pytest.mark.parametrize('tokens', [1, 5, 40])
def test_folded_block_equals_unfolded(monkeypatch, dtype, tokens):
    block = make_block(dtype)
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    routes_plain, routes_folded = (torch.empty(tokens, 2, dtype=torch.int16) for _ in range(2))
    monkeypatch.setattr(nn_moe, '_FOLD_SHARED', False)
    plain = block(x, routes_plain)
    monkeypatch.setattr(nn_moe, '_FOLD_SHARED', True)
    assert block.foldable_shared(tokens) is not None
    folded = block(x, routes_folded)
    torch.testing.assert_close(folded, plain, rtol=0, atol=0)
    torch.testing.assert_close(routes_folded, routes_plain, rtol=0, atol=0)


def test_the_fold_applies_only_where_it_can(monkeypatch):
    monkeypatch.setattr(nn_moe, '_FOLD_SHARED', True)
    block = make_block(torch.float32)
    assert block.foldable_shared(nn_moe.FOLD_MAX_TOKENS) is not None
    assert block.foldable_shared(nn_moe.FOLD_MAX_TOKENS + 1) is None             # prefill: separate shared GEMMs
    assert make_block(torch.float32, shared_inter=48).foldable_shared(1) is None  # not one routed expert's shape
    assert nn_moe.SparseMoeBlock(32, 8, 2, 24).foldable_shared(1) is None         # no shared expert
    block.shared_expert.gate_up_proj.lora = object()                              # an adapter on the shared expert
    assert block.foldable_shared(1) is None
    block = make_block(torch.float32)
    block.experts.weight_block_size = (128, 128)                                  # FP8 experts
    assert block.foldable_shared(1) is None
    monkeypatch.setattr(nn_moe, '_FOLD_SHARED', False)
    assert make_block(torch.float32).foldable_shared(1) is None                   # off unless switched on


def test_the_backend_op_sets_the_fold_bound(monkeypatch):
    """Without `LMDEPLOY_MOE_FOLD_SHARED`, the bound is the experts' op's own `fold_shared_max_tokens` (the cuda
    backend's few-token MoE, on unless `LMDEPLOY_MOE_GEMV=0`); the default backend's op asks for none."""
    monkeypatch.setattr(nn_moe, '_FOLD_SHARED', False)
    block = make_block(torch.float32)
    assert block.experts.fold_shared_max_tokens == 0 and block.fold_max_tokens() == 0
    assert block.foldable_shared(1) is None and block.foldable_shared(0) is None
    block.experts.fold_shared_max_tokens = 4
    assert block.fold_max_tokens() == 4
    assert block.foldable_shared(4) is not None and block.foldable_shared(5) is None


@pytest.mark.parametrize('tokens', [1, 3])
def test_folded_block_with_stacked_projections(monkeypatch, tokens):
    """Stacked input projections: the folded forward takes the router's and the shared gate's logits from one GEMM
    over their rows of the stack (the router's and the shared gate's own modules never run) and equals the unfolded
    block, routes bit for bit."""
    block = make_block(torch.float32)
    assert block.fuse_input_projections()
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(tokens))
    routes_plain, routes_folded = (torch.empty(tokens, 2, dtype=torch.int16) for _ in range(2))
    monkeypatch.setattr(nn_moe, '_FOLD_SHARED', False)
    plain = block(x, routes_plain)
    block.experts.fold_shared_max_tokens = 4

    def must_not_run(*_args, **_kwargs):
        raise AssertionError('a separate router or shared-gate GEMM ran in the folded forward')
    monkeypatch.setattr(block.gate, 'forward', must_not_run)
    monkeypatch.setattr(block.shared_expert_gate, 'forward', must_not_run)
    folded = block(x, routes_folded)
    torch.testing.assert_close(folded, plain, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(routes_folded, routes_plain, rtol=0, atol=0)


def test_cuda_backend_moe_asks_for_the_fold_with_its_few_token_path(monkeypatch):
    pytest.importorskip('triton')
    from lmdeploy.pytorch.backends import cuda as cuda_backend
    from lmdeploy.pytorch.kernels.cuda import moe as cuda_moe
    from lmdeploy.pytorch.kernels.cuda.moe_gemv import MAX_TOKENS
    monkeypatch.setattr(cuda_moe, '_MOE_GEMV', True)
    impl = cuda_backend._build_moe()
    assert impl.func is cuda_moe.fused_moe and impl.fold_shared_max_tokens == MAX_TOKENS
    monkeypatch.setattr(cuda_moe, '_MOE_GEMV', False)
    assert cuda_backend._build_moe().fold_shared_max_tokens == 0
