"""Triton MoE router tail: softmax over the expert logits, top-k, optional renormalisation, in one launch.

Semantics of `nn/moe.py`'s `TopKRouter` after its logits matmul (`backends/default/moe.py: softmax_topk`): the
probabilities are a float32 softmax of the logits; the k largest are taken in descending order (ties go to the
lower expert id; torch leaves their order unspecified); with `renormalize` they are divided by their sum (summed in
descending order); the weights are returned in the logits' dtype and the ids as int64.

One program routes one token: it holds the row's `num_experts` logits in registers (BLOCK_E = next power of two)
and picks the k winners by k rounds of max + lowest-index-of-max (`route_row`).

`norm_route` runs a MoE layer's input norm (with the residual add before it), the router's one-row GEMV and this
routing as one launch for a few tokens (a decode step's MoE layers), where they were three launches of a few
microseconds each; the `cuda` backend's `OpType.NormRoute` with `LMDEPLOY_NORM_ROUTE=1` (opt-in: its first form,
four warps and two router rows a program, was slower than the three launches on the H100, run 47; this one, a warp
and a row a program, is not yet measured).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import arrival_counters, fast_kernel, wait_for_inputs

_MAX_EXPERTS = 4096


@triton.jit
def route_row(logits, shared_logit, offs, num_experts, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
              HAS_SHARED: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """(weights [BLOCK_K] float32, ids [BLOCK_K] int64) of one token from its float32 logits at lanes `offs`
    (lanes past `num_experts` are ignored) and, with HAS_SHARED, the shared expert's float32 gate logit: the module
    docstring's semantics, columns past the routed ones and the shared one zero."""
    mask = offs < num_experts
    logits = tl.where(mask, logits, -float('inf'))
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
        top_w = tl.where(ks == TOP_K, tl.sigmoid(shared_logit), top_w)
        top_i = tl.where(ks == TOP_K, num_experts, top_i)
    return top_w, top_i


@fast_kernel
@triton.jit
def _topk_softmax_kernel(logits_ptr, shared_ptr, weights_ptr, ids_ptr, num_experts, stride_l, stride_s, stride_w,
                         stride_i, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_SHARED: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + row * stride_l + offs, mask=offs < num_experts, other=-float('inf'))
    shared = 0.0
    if HAS_SHARED:
        shared = tl.load(shared_ptr + row * stride_s).to(tl.float32)
    top_w, top_i = route_row(logits.to(tl.float32), shared, offs, num_experts, TOP_K, RENORMALIZE, HAS_SHARED,
                             BLOCK_E, BLOCK_K)
    ks = tl.arange(0, BLOCK_K)
    kmask = ks < TOP_K + HAS_SHARED
    tl.store(weights_ptr + row * stride_w + ks, top_w.to(weights_ptr.dtype.element_ty), mask=kmask)
    tl.store(ids_ptr + row * stride_i + ks, top_i, mask=kmask)


@fast_kernel
@triton.jit
def _norm_route_kernel(x_ptr, res_ptr, norm_w_ptr, w_ptr, res_out_ptr, h_ptr, logits_ptr, count_ptr, weights_ptr,
                       ids_ptr, hidden, num_rows, num_experts, stride_x, stride_res, stride_wn, stride_h, stride_l,
                       stride_w, stride_i, eps, ZERO_CENTERED: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                       TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_SHARED: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                       PDL: tl.constexpr = False):
    """Program (token, block of BLOCK_N router rows); see `norm_route`."""
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < num_rows
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < hidden
    # the router's rows and the norm scale before the PDL wait: weights only start-up writes (`launch.py`)
    w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_wn + cols[None, :],
                mask=row_mask[:, None] & col_mask[None, :], other=0.0)
    scale = tl.load(norm_w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        scale += 1.0
    wait_for_inputs(PDL)
    dtype = h_ptr.dtype.element_ty
    s = tl.load(x_ptr + token * stride_x + cols, mask=col_mask, other=0.0)
    if HAS_RESIDUAL:  # the residual stream: x + residual rounded to x's dtype, as the unfused add stores it
        r = tl.load(res_ptr + token * stride_res + cols, mask=col_mask, other=0.0)
        s = (s.to(tl.float32) + r.to(tl.float32)).to(dtype)
    s32 = s.to(tl.float32)
    h = (s32 * tl.rsqrt(tl.sum(s32 * s32, axis=0) / hidden + eps) * scale).to(dtype)
    # the linear's output in x's dtype, as the unfused router's GEMV rounds it
    logit = tl.sum(w.to(tl.float32) * h.to(tl.float32)[None, :], axis=1).to(dtype).to(tl.float32)
    tl.store(logits_ptr + token * stride_l + rows, logit, mask=row_mask)
    if block == 0:
        tl.store(h_ptr + token * stride_h + cols, h, mask=col_mask)
        if HAS_RESIDUAL:
            tl.store(res_out_ptr + token * stride_h + cols, s, mask=col_mask)
    # The token's last program to finish routes it: every thread's logit stores precede the barrier, and the
    # counter's acq_rel add orders them before the last program's reads (which bypass L1); that program then
    # puts the counter back to 0 for the next launch (CUDA graph replays included).
    tl.debug_barrier()
    done = tl.atomic_add(count_ptr + token, 1, sem='acq_rel')
    if done == tl.num_programs(1) - 1:
        offs = tl.arange(0, BLOCK_E)
        logits = tl.load(logits_ptr + token * stride_l + offs, mask=offs < num_experts, other=-float('inf'),
                         cache_modifier='.cg')
        shared = 0.0
        if HAS_SHARED:
            shared = tl.load(logits_ptr + token * stride_l + num_experts, cache_modifier='.cg')
        top_w, top_i = route_row(logits, shared, offs, num_experts, TOP_K, RENORMALIZE, HAS_SHARED, BLOCK_E,
                                 BLOCK_K)
        ks = tl.arange(0, BLOCK_K)
        kmask = ks < TOP_K + HAS_SHARED
        tl.store(weights_ptr + token * stride_w + ks, top_w.to(weights_ptr.dtype.element_ty), mask=kmask)
        tl.store(ids_ptr + token * stride_i + ks, top_i, mask=kmask)
        tl.atomic_xchg(count_ptr + token, 0)


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


NORM_ROUTE_MAX_TOKENS = 64   # tokens a `norm_route` launch takes (one counter each)
_NORM_ROUTE_MAX_HIDDEN = 8192  # a program holds the whole normed row and BLOCK_N router rows in registers


def _route_counters(device: torch.device) -> torch.Tensor:
    """The per-token arrival counters of `_norm_route_kernel` on `device` (`launch.arrival_counters`)."""
    return arrival_counters('norm_route', NORM_ROUTE_MAX_TOKENS, device)


def norm_route_supported(x: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether `norm_route` takes x [T, H] and the router rows: few tokens with contiguous rows, a width one program
    holds, the rows' dtype x's."""
    return (x.dim() == 2 and 0 < x.shape[0] <= NORM_ROUTE_MAX_TOKENS and x.shape[1] <= _NORM_ROUTE_MAX_HIDDEN
            and x.stride(-1) == 1 and rows.dtype == x.dtype and rows.stride(-1) == 1
            and rows.shape[0] - 1 <= _MAX_EXPERTS)


def norm_route(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
               zero_centered: bool, rows: torch.Tensor, top_k: int, renormalize: bool, has_shared: bool
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A MoE layer's input norm and its router in one launch, for a few tokens (`norm_route_supported`):
    (weights [T, k (+1)], ids [T, k (+1)], s, h) where s = x + residual (x itself when residual is None) rounded to
    x's dtype, h = RMSNorm(s) (scale 1 + w when `zero_centered`) in x's dtype, and the routing is `softmax_topk` of
    the logits `F.linear(h, rows)` rounded to x's dtype: rows [E (+1), H] are the router's (and with `has_shared`
    last the shared expert's gate row, its column id E with weight sigmoid(logit)).

    Program (token, router row) normalises the whole row (each program alike, from the same loads), dots it with
    its row and stores the logit; the token's last program to arrive (an atomic counter per token)
    routes from all of them. Program 0 of a token writes s and h. Three launches (norm, router GEMV, top-k) in one:
    a decode step's MoE layers each run these before the experts."""
    num_tokens, hidden = x.shape
    num_rows = rows.shape[0]
    num_experts = num_rows - int(has_shared)
    assert norm_route_supported(x, rows), f'norm_route: x {tuple(x.shape)}, rows {tuple(rows.shape)}'
    assert rows.shape[1] == hidden and norm_weight.shape == (hidden,) and 0 < top_k <= num_experts
    assert residual is None or (residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1)
    cols = top_k + int(has_shared)
    weights = torch.empty(num_tokens, cols, dtype=x.dtype, device=x.device)
    ids = torch.empty(num_tokens, cols, dtype=torch.int64, device=x.device)
    h = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    s = torch.empty_like(h) if residual is not None else x
    logits = torch.empty(num_tokens, num_rows, dtype=torch.float32, device=x.device)
    block_h = triton.next_power_of_2(hidden)
    # One router row a program, on as few warps as hold the row (one up to 2048 wide): the norm's, the dot's and
    # the routing's reductions then stay inside a warp, as the one-warp routing kernel's do.
    _norm_route_kernel[(num_tokens, num_rows)](
        x, residual if residual is not None else x, norm_weight if norm_weight.stride(0) == 1 else
        norm_weight.contiguous(), rows, s, h, logits, _route_counters(x.device), weights, ids, hidden, num_rows,
        num_experts, x.stride(0), residual.stride(0) if residual is not None else x.stride(0), rows.stride(0),
        h.stride(0), logits.stride(0), weights.stride(0), ids.stride(0), float(eps), ZERO_CENTERED=zero_centered,
        HAS_RESIDUAL=residual is not None, TOP_K=top_k, RENORMALIZE=renormalize, HAS_SHARED=int(has_shared),
        BLOCK_H=block_h, BLOCK_N=1, BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_K=triton.next_power_of_2(cols), num_warps=max(1, min(4, block_h // 2048)))
    return weights, ids, s, h
