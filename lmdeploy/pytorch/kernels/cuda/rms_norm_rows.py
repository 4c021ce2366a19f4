"""Triton RMSNorm for short and per-head rows (the `cuda` backend's default; `LMDEPLOY_FUSED_PREFILL=0` goes back to
`rms_norm.py`, see `backends/cuda`); semantics and entry points of `rms_norm.py` (`rms_norm`, `add_rms_norm`,
`gated_rms_norm`).

Two changes against `rms_norm.py`: short rows share a program (`_rows_per_program`: up to 16 rows of one width,
each reduced on its own; one 128-wide row per program leaves most of a warp idle), and x and the gate are read in
place when their rows can be viewed as [rows, D] or as [outer, inner, D] (row r at outer r // inner, inner
r % inner: per-head rows of a channel slice of a wider projection, such as gated DeltaNet's z, which `rms_norm.py`
copies first); anything else is copied. A program normalises its rows in float32 and writes a new contiguous
tensor of the input's shape and dtype. With a residual, a row is first `x + residual` rounded to the input dtype
(what the unfused `x + residual` in that dtype produces); that sum is stored as the new residual and is what gets
normalised.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import fast_kernel, wait_for_inputs
from .rms_norm import norm_entry_points


@fast_kernel
@triton.jit
def _rms_norm_rows_kernel(x_ptr, gate_ptr, res_ptr, res_out_ptr, w_ptr, out_ptr, num_rows, stride_x, stride_x_inner,
                     x_inner, stride_gate, stride_gate_inner, gate_inner, stride_res, stride_res_out, stride_out, dim,
                     eps, ZERO_CENTERED: tl.constexpr, HAS_GATE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """ROWS rows per program (many for short rows, such as per-head norms of 128); each row reduces alone."""
    wait_for_inputs(PDL)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (offs < dim)[None, :]
    x_rows = (rows // x_inner) * stride_x + (rows % x_inner) * stride_x_inner  # x_inner == 1: rows * stride_x
    x = tl.load(x_ptr + x_rows[:, None] + offs[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + rows[:, None] * stride_res + offs[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + rows[:, None] * stride_res_out + offs[None, :], x, mask=mask)
    x = x.to(tl.float32)
    x = x * tl.rsqrt(tl.sum(x * x, axis=1) / dim + eps)[:, None]
    w = tl.load(w_ptr + offs, mask=offs < dim, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    y = x * w[None, :]
    if HAS_GATE:
        gate_rows = (rows // gate_inner) * stride_gate + (rows % gate_inner) * stride_gate_inner
        gate = tl.load(gate_ptr + gate_rows[:, None] + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        y = y * gate * tl.sigmoid(gate)
    tl.store(out_ptr + rows[:, None] * stride_out + offs[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows_per_program(block: int) -> int:
    """Short rows share a program (up to 16 rows, 2048 elements): one row of 128 per program leaves most of each
    program's warp idle and launches a program per 256 bytes. Depends on the width only, so a row's result does
    not depend on the batch it is in."""
    return max(1, min(16, 2048 // block))


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [rows, D] with unit stride along D (a view when the layout allows)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _row_layout(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(tensor, outer stride, inner stride, inner count): row r of x's [..., D] rows starts at element
    (r // inner) * outer + (r % inner) * inner_stride of the tensor; inner is 1 for a plain [rows, D] view. Copies
    only when neither [rows, D] nor [outer, inner, D] with unit stride along D is a view of x."""
    if x.dim() >= 3 and x.stride(-1) == 1:
        try:
            rows = x.view(-1, x.shape[-1])
        except RuntimeError:  # rows not evenly spaced: try [outer, inner, D]
            try:
                heads = x.view(-1, x.shape[-2], x.shape[-1])
                return heads, heads.stride(0), heads.stride(1), heads.shape[1]
            except RuntimeError:
                rows = x.contiguous().view(-1, x.shape[-1])
        return rows, rows.stride(0), 0, 1
    rows = _as_rows(x)
    return rows, rows.stride(0), 0, 1


def _launch(x: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor, eps: float,
            zero_centered: bool, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(normed, new residual or None)."""
    dim = x.shape[-1]
    assert weight.shape == (dim,), f'weight {tuple(weight.shape)} does not match the last dim {dim}'
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    if x.numel() == 0:
        return out, res_out
    x_rows, stride_x, stride_x_inner, x_inner = _row_layout(x)
    gate_rows, stride_gate, stride_gate_inner, gate_inner = \
        _row_layout(gate) if gate is not None else (x_rows, stride_x, stride_x_inner, x_inner)
    res_rows = _as_rows(residual) if residual is not None else out.view(-1, dim)
    res_out_rows = res_out.view(-1, dim) if res_out is not None else out.view(-1, dim)
    out_rows = out.view(-1, dim)
    block = triton.next_power_of_2(dim)
    rows_per_program = _rows_per_program(block)
    num_rows = out_rows.shape[0]
    _rms_norm_rows_kernel[(triton.cdiv(num_rows, rows_per_program),)](
        x_rows, gate_rows, res_rows, res_out_rows, weight if weight.stride(0) == 1 else weight.contiguous(),
        out_rows, num_rows=num_rows, stride_x=stride_x, stride_x_inner=stride_x_inner, x_inner=x_inner,
        stride_gate=stride_gate, stride_gate_inner=stride_gate_inner, gate_inner=gate_inner,
        stride_res=res_rows.stride(0), stride_res_out=res_out_rows.stride(0), stride_out=out_rows.stride(0),
        dim=dim, eps=float(eps),
        ZERO_CENTERED=zero_centered, HAS_GATE=gate is not None, HAS_RESIDUAL=residual is not None,
        ROWS=rows_per_program, BLOCK=block, num_warps=min(max(rows_per_program * block // 256, 1), 16),
    )
    return out, res_out


rms_norm, add_rms_norm, gated_rms_norm = norm_entry_points(_launch)
