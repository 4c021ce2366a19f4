"""Triton RMSNorm (plain, zero-centred, gated, residual-add); semantics of `backends/default/elementwise.py`.

One program normalises one row of the last dimension in float32 and writes a new contiguous tensor of the input's
shape and dtype. Leading dimensions are flattened into rows (copying only when they cannot be viewed as rows).
With a residual, the row is first `x + residual` rounded to the input dtype (what the unfused `x + residual` in
that dtype produces); that sum is stored as the new residual and is what gets normalised.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .launch import fast_kernel, wait_for_inputs


@fast_kernel
@triton.jit
def _rms_norm_kernel(x_ptr, gate_ptr, res_ptr, res_out_ptr, w_ptr, out_ptr, stride_x, stride_gate, stride_res,
                     stride_res_out, stride_out, dim, eps, ZERO_CENTERED: tl.constexpr, HAS_GATE: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < dim
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + offs, x, mask=mask)
    x = x.to(tl.float32)
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
            zero_centered: bool, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(normed, new residual or None)."""
    dim = x.shape[-1]
    assert weight.shape == (dim,), f'weight {tuple(weight.shape)} does not match the last dim {dim}'
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    if x.numel() == 0:
        return out, res_out
    x_rows = _as_rows(x)
    gate_rows = _as_rows(gate) if gate is not None else x_rows
    res_rows = _as_rows(residual) if residual is not None else x_rows
    res_out_rows = res_out.view(-1, dim) if res_out is not None else x_rows
    out_rows = out.view(-1, dim)
    block = triton.next_power_of_2(dim)
    _rms_norm_kernel[(x_rows.shape[0],)](
        x_rows, gate_rows, res_rows, res_out_rows, weight if weight.stride(0) == 1 else weight.contiguous(),
        out_rows, stride_x=x_rows.stride(0), stride_gate=gate_rows.stride(0), stride_res=res_rows.stride(0),
        stride_res_out=res_out_rows.stride(0), stride_out=out_rows.stride(0), dim=dim, eps=float(eps),
        ZERO_CENTERED=zero_centered, HAS_GATE=gate is not None, HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=min(max(block // 256, 1), 16),
    )
    return out, res_out


class NormEntryPoints(NamedTuple):
    """`rms_norm`, `add_rms_norm` and `gated_rms_norm` over one launcher (this module's or `rms_norm_rows`')."""
    rms_norm: Callable[..., torch.Tensor]
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    gated_rms_norm: Callable[..., torch.Tensor]


def norm_entry_points(launch: Callable) -> NormEntryPoints:
    """The three entry points over `launch(x, gate, weight, eps, zero_centered, residual=None) -> (out, res_out)`."""

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
        """RMSNorm in float32; `zero_centered` scales by (1 + weight) as Qwen3-Next/Qwen3.5 do."""
        return launch(x, None, weight, eps, zero_centered)[0]

    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     zero_centered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual), the sum rounded to x's dtype, in one launch."""
        assert residual.shape == x.shape and residual.dtype == x.dtype, \
            f'residual {tuple(residual.shape)} {residual.dtype} != x {tuple(x.shape)} {x.dtype}'
        return launch(x, None, weight, eps, zero_centered, residual)

    def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * rmsnorm(x) * silu(gate), normalised in float32 (the gated DeltaNet output norm)."""
        assert gate.shape == x.shape, f'gate {tuple(gate.shape)} != x {tuple(x.shape)}'
        return launch(x, gate, weight, eps, False)[0]

    return NormEntryPoints(rms_norm, add_rms_norm, gated_rms_norm)


rms_norm, add_rms_norm, gated_rms_norm = norm_entry_points(_launch)
