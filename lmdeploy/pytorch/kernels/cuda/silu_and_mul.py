"""Triton SiLU-and-mul: `silu(x[..., :d]) * x[..., d:]` for a fused gate/up projection of width 2d, in one pass.

Semantics of `backends/default/elementwise.silu_and_mul` (torch's `F.silu(gate) * up`, which is also what
transformers' MLPs compute): silu in float32 rounded to the input dtype, then the product of that and `up` in
float32 rounded to the input dtype. The torch pair costs two strided kernels and a [T, d] intermediate written and
read back; this kernel reads every input byte once and writes the [T, d] output once.

Grid: (rows, cdiv(d, BLOCK)), from shapes only (no host read-back), so it is capturable in a CUDA graph. Rows
are the flattened leading dimensions (any count, 0 included); `d` need not be a multiple of BLOCK (masked tail).
Every element depends only on its own gate and up values, so a token's output does not depend on the batch it
sits in (exact-parity paths such as CUDA graphs vs eager and prefix cache on vs off agree bit for bit).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import fast_kernel

_BLOCK = 1024  # 8 bf16 per thread at 4 warps: 16-byte vector accesses when d and the row stride allow


@fast_kernel
@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    x_row = x_ptr + row * stride_x
    gate = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + width + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


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
