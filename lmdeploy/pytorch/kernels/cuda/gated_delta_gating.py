"""Triton gated DeltaNet gating, one launch: semantics of `nn/gated_delta.py: gated_delta_gating`.

From the per-head projections a, b [T, H] (any float dtype, unit stride along H):
    g    = -exp(A_log) * softplus(a + dt_bias)     in float32 (softplus as torch's: x above 20 passes through)
    beta = sigmoid(b)                              rounded to b's dtype
A program covers one token's heads; the torch form is eight small ops.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import fast_kernel, wait_for_inputs

SOFTPLUS_THRESHOLD = 20.0


@triton.jit
def gating_values(a, b, a_log, dt_bias, THRESHOLD: tl.constexpr):
    """(g, beta) in float32 from float32 a, b, A_log, dt_bias (any shapes that broadcast); the gating kernel's and
    the recurrent rule's in-kernel gating (`fused_recurrent_gated_delta.py`) share it, so both compute the same
    bits. beta is still to be rounded to b's dtype."""
    x = a + dt_bias
    # softplus(x) = max(x, 0) + log1p(exp(-|x|)), log1p(y) = log(u) * y / (u - 1) with u = 1 + y (exact to a few
    # ulp for small y, where log(1 + y) would lose the digits)
    y = tl.exp(-tl.abs(x))
    u = 1.0 + y
    log1p = tl.where(u == 1.0, y, tl.log(u) * y / tl.where(u == 1.0, 1.0, u - 1.0))
    softplus = tl.where(x > THRESHOLD, x, tl.maximum(x, 0.0) + log1p)
    g = -tl.exp(a_log) * softplus
    beta = 1.0 / (1.0 + tl.exp(-b))
    return g, beta


@fast_kernel
@triton.jit
def _gating_kernel(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, stride_a, stride_b, num_heads,
                   THRESHOLD: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    mask = heads < num_heads
    a = tl.load(a_ptr + row * stride_a + heads, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + row * stride_b + heads, mask=mask, other=0.0).to(tl.float32)
    a_log = tl.load(a_log_ptr + heads, mask=mask, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + heads, mask=mask, other=0.0).to(tl.float32)
    g, beta = gating_values(a, b, a_log, dt_bias, THRESHOLD)
    tl.store(g_ptr + row * num_heads + heads, g, mask=mask)
    tl.store(beta_ptr + row * num_heads + heads, beta.to(beta_ptr.dtype.element_ty), mask=mask)


def gated_delta_gating(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(g [T, H] float32, beta [T, H] in b's dtype); see the module docstring."""
    num_tokens, num_heads = a.shape
    assert b.shape == a.shape and A_log.shape == dt_bias.shape == (num_heads,), \
        f'a {tuple(a.shape)}, b {tuple(b.shape)}, A_log {tuple(A_log.shape)}, dt_bias {tuple(dt_bias.shape)}'
    g = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=a.device)
    beta = torch.empty(num_tokens, num_heads, dtype=b.dtype, device=b.device)
    if num_tokens == 0:
        return g, beta
    a, b = (x if x.stride(-1) == 1 else x.contiguous() for x in (a, b))
    A_log, dt_bias = A_log.contiguous(), dt_bias.contiguous()
    _gating_kernel[(num_tokens,)](a, b, A_log, dt_bias, g, beta, stride_a=a.stride(0), stride_b=b.stride(0),
                                  num_heads=num_heads, THRESHOLD=SOFTPLUS_THRESHOLD,
                                  BLOCK_H=triton.next_power_of_2(num_heads), num_warps=1)
    return g, beta
