"""Triton gated activations, each one pass over its inputs; semantics of `backends/default/elementwise.py`.
The `cuda` backend's default (verified on the H200 in run 6); `LMDEPLOY_FUSED_PREFILL=0` runs torch's pairs.

* `silu_and_mul(x)`: `silu(x[..., :d]) * x[..., d:]` for a fused gate/up projection of width 2d (the MLPs).
* `sigmoid_gate_mul(x, gate)`: `x * sigmoid(gate)` (gated attention's output gate; `gate` is usually a strided
  per-head slice of the query projection).

Both round like torch's unfused pair (`F.silu(gate) * up`, `x * torch.sigmoid(gate)`, which is also what
transformers computes): the activation in float32 rounded to the input dtype, then the product in float32 rounded
to the input dtype. The torch pairs cost two kernels (strided ones when the inputs are slices) and an intermediate
written and read back; these kernels read every input byte once and write the output once.

Grids come from shapes only (no host read-back), so both are capturable in a CUDA graph; any row count (0
included) and widths that are not a multiple of the block (masked tail). Every element depends only on its own
inputs, so a token's output does not depend on the batch it sits in (exact-parity paths such as CUDA graphs vs
eager, prefix cache on vs off, agree bit for bit).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import fast_kernel, wait_for_inputs

_BLOCK = 1024  # 8 bf16 per thread at 4 warps: 16-byte vector accesses when widths and row strides allow


@fast_kernel
@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, width, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    x_row = x_ptr + row * stride_x
    gate = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + width + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


@fast_kernel
@triton.jit
def _sigmoid_gate_mul_kernel(x_ptr, gate_ptr, out_ptr, stride_xt, stride_xh, stride_gt, stride_gh, num_heads,
                             head_dim, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Row t of [T, H * D]; element (h, d) of x / gate at t * stride_t + h * stride_h + d."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_heads * head_dim
    head, col = offs // head_dim, offs % head_dim
    x = tl.load(x_ptr + row * stride_xt + head * stride_xh + col, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + row * stride_gt + head * stride_gh + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * num_heads * head_dim + offs, sigmoid_gated(x, gate, out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def sigmoid_gated(x, gate, DTYPE: tl.constexpr):
    """x * sigmoid(gate) in DTYPE, rounded like torch's unfused pair: x and sigmoid(gate) each rounded to DTYPE,
    then their product (x and gate in float32; also the decode attention merge's epilogue, `paged_attention.py`)."""
    act = (1.0 / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32)
    return (x.to(DTYPE).to(tl.float32) * act).to(DTYPE)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2d] -> silu(x[..., :d]) * x[..., d:] [..., d], a new contiguous tensor in x's dtype."""
    assert x.shape[-1] % 2 == 0, f'the last dim {x.shape[-1]} is not gate + up of equal widths'
    width = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], width), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out_rows = out.view(-1, width)
    grid = (rows.shape[0], triton.cdiv(width, _BLOCK))
    _silu_and_mul_kernel[grid](rows, out_rows, stride_x=rows.stride(0), stride_out=out_rows.stride(0), width=width,
                               BLOCK=_BLOCK, num_warps=4)
    return out


def _as_heads(x: torch.Tensor) -> torch.Tensor:
    """[..., H, D] -> a [T, H, D] view with unit stride along D (a copy only when no such view exists)."""
    if x.stride(-1) == 1:
        try:
            return x.view(-1, *x.shape[-2:])
        except RuntimeError:
            pass
    return x.contiguous().view(-1, *x.shape[-2:])


def sigmoid_gate_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate) for x, gate [..., H, D] (any strides), a new contiguous tensor in x's dtype."""
    assert gate.shape == x.shape and gate.dtype == x.dtype and x.dim() >= 2, \
        f'gate {tuple(gate.shape)} {gate.dtype} != x {tuple(x.shape)} {x.dtype}'
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x3, gate3 = _as_heads(x), _as_heads(gate)
    num_tokens, num_heads, head_dim = x3.shape
    grid = (num_tokens, triton.cdiv(num_heads * head_dim, _BLOCK))
    _sigmoid_gate_mul_kernel[grid](x3, gate3, out, stride_xt=x3.stride(0), stride_xh=x3.stride(1),
                                   stride_gt=gate3.stride(0), stride_gh=gate3.stride(1), num_heads=num_heads,
                                   head_dim=head_dim, BLOCK=_BLOCK, num_warps=4)
    return out
