"""Triton MoE router tail: softmax over the expert logits, top-k, optional renormalisation, in one launch.

Semantics of `nn/moe.py`'s `TopKRouter` after its logits matmul (`backends/default/moe.py: softmax_topk`): the
probabilities are a float32 softmax of the logits; the k largest are taken in descending order (ties go to the
lower expert id; torch leaves their order unspecified); with `renormalize` they are divided by their sum (summed in
descending order); the weights are returned in the logits' dtype and the ids as int64.

One program routes one token: it holds the row's `num_experts` logits in registers (BLOCK_E = next power of two)
and picks the k winners by k rounds of max + lowest-index-of-max.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import fast_kernel

_MAX_EXPERTS = 4096


@fast_kernel
@triton.jit
def _topk_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_l, stride_w, stride_i,
                         TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < num_experts
    logits = tl.load(logits_ptr + row * stride_l + offs, mask=mask, other=-float('inf')).to(tl.float32)
    shifted = tl.exp(logits - tl.max(logits, axis=0))
    probs = shifted / tl.sum(shifted, axis=0)
    # Valid experts are >= -1 (a NaN probability, e.g. from a CUDA graph's garbage padding row, becomes -1, so the
    # ids stay valid and distinct as torch.topk's do), taken ones -2, padding lanes -3: padding never wins.
    probs = tl.where(mask, tl.where(probs == probs, probs, -1.0), -3.0)
    ks = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_K], dtype=tl.int64)
    total = 0.0
    for k in tl.static_range(TOP_K):
        best = tl.max(probs, axis=0)
        best_id = tl.minimum(tl.min(tl.where(probs == best, offs, BLOCK_E), axis=0), num_experts - 1)
        top_w = tl.where(ks == k, best, top_w)
        top_i = tl.where(ks == k, best_id.to(tl.int64), top_i)
        total += best
        probs = tl.where(offs == best_id, -2.0, probs)
    if RENORMALIZE:
        top_w = top_w / total
    kmask = ks < TOP_K
    tl.store(weights_ptr + row * stride_w + ks, top_w.to(weights_ptr.dtype.element_ty), mask=kmask)
    tl.store(ids_ptr + row * stride_i + ks, top_i, mask=kmask)


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] in logits' dtype, expert ids [T, k] int64)."""
    num_tokens, num_experts = logits.shape
    assert 0 < top_k <= num_experts <= _MAX_EXPERTS, f'top_k {top_k} of {num_experts} experts'
    weights = torch.empty(num_tokens, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    block_e = triton.next_power_of_2(num_experts)
    _topk_softmax_kernel[(num_tokens,)](
        logits, weights, ids, num_experts, stride_l=logits.stride(0), stride_w=weights.stride(0),
        stride_i=ids.stride(0), TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k), num_warps=1 if block_e <= 256 else 4)
    return weights, ids
