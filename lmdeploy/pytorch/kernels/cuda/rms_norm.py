"""Triton RMSNorm (plain, zero-centred, gated); semantics of `backends/default/elementwise.py`.

One program normalises one row of the last dimension in float32 and writes a new contiguous tensor of the input's
shape and dtype. Leading dimensions are flattened into rows (copying only when they cannot be viewed as rows).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, gate_ptr, w_ptr, out_ptr, stride_x, stride_gate, stride_out, dim, eps,
                     ZERO_CENTERED: tl.constexpr, HAS_GATE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < dim
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    x = x * tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    y = x * w
    if HAS_GATE:
        gate = tl.load(gate_ptr + row * stride_gate + offs, mask=mask, other=0.0).to(tl.float32)
        y = y * gate * tl.sigmoid(gate)
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [rows, D] with unit stride along D (a view when the layout allows)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(x: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor, eps: float,
            zero_centered: bool) -> torch.Tensor:
    dim = x.shape[-1]
    assert weight.shape == (dim,), f'weight {tuple(weight.shape)} does not match the last dim {dim}'
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    x_rows = _as_rows(x)
    gate_rows = _as_rows(gate) if gate is not None else x_rows
    out_rows = out.view(-1, dim)
    block = triton.next_power_of_2(dim)
    _rms_norm_kernel[(x_rows.shape[0],)](
        x_rows, gate_rows, weight.contiguous(), out_rows,
        stride_x=x_rows.stride(0), stride_gate=gate_rows.stride(0), stride_out=out_rows.stride(0),
        dim=dim, eps=float(eps), ZERO_CENTERED=zero_centered, HAS_GATE=gate is not None, BLOCK=block,
        num_warps=min(max(block // 256, 1), 16),
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    """RMSNorm in float32; `zero_centered` scales by (1 + weight) as Qwen3-Next/Qwen3.5 do."""
    return _launch(x, None, weight, eps, zero_centered)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rmsnorm(x) * silu(gate), normalised in float32 (the gated DeltaNet output norm)."""
    assert gate.shape == x.shape, f'gate {tuple(gate.shape)} != x {tuple(x.shape)}'
    return _launch(x, gate, weight, eps, False)
