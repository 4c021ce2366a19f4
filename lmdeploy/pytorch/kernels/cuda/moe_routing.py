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

from .launch import fast_kernel, wait_for_inputs

_MAX_EXPERTS = 4096


@fast_kernel
@triton.jit
def _topk_softmax_kernel(logits_ptr, shared_ptr, weights_ptr, ids_ptr, num_experts, stride_l, stride_s, stride_w,
                         stride_i, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_SHARED: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
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
    if HAS_SHARED:  # column TOP_K: the shared expert (id num_experts), scaled by sigmoid of its gate logit
        gate = tl.load(shared_ptr + row * stride_s).to(tl.float32)
        top_w = tl.where(ks == TOP_K, tl.sigmoid(gate), top_w)
        top_i = tl.where(ks == TOP_K, num_experts, top_i)
    kmask = ks < TOP_K + HAS_SHARED
    tl.store(weights_ptr + row * stride_w + ks, top_w.to(weights_ptr.dtype.element_ty), mask=kmask)
    tl.store(ids_ptr + row * stride_i + ks, top_i, mask=kmask)


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool, shared_logit: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] in logits' dtype, expert ids [T, k] int64). With `shared_logit` [T, 1] (a
    shared expert's gate logits): one more column, id E and weight sigmoid(logit) (in float32, then logits'
    dtype: `torch.sigmoid` of the logit), for `fused_moe(..., shared=...)`."""
    num_tokens, num_experts = logits.shape
    assert 0 < top_k <= num_experts <= _MAX_EXPERTS, f'top_k {top_k} of {num_experts} experts'
    has_shared = int(shared_logit is not None)
    assert shared_logit is None or shared_logit.shape == (num_tokens, 1)
    weights = torch.empty(num_tokens, top_k + has_shared, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(num_tokens, top_k + has_shared, dtype=torch.int64, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    block_e = triton.next_power_of_2(num_experts)
    shared = shared_logit if shared_logit is not None else logits
    _topk_softmax_kernel[(num_tokens,)](
        logits, shared, weights, ids, num_experts, stride_l=logits.stride(0), stride_s=shared.stride(0),
        stride_w=weights.stride(0), stride_i=ids.stride(0), TOP_K=top_k, RENORMALIZE=renormalize,
        HAS_SHARED=has_shared, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k + has_shared),
        num_warps=1 if block_e <= 256 else 4)
    return weights, ids
