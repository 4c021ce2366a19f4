"""Non-causal variable-length attention over packed sequences (the vision tower's per-image attention); reference:
`kernels/default/varlen_attention.py`.

q, k, v are `[N, H, D]` with sequence `b` in rows `[cu_seqlens[b], cu_seqlens[b + 1])`; every query of a sequence
attends to every key of the same sequence and to nothing else. Program `(m, h, b)` owns query rows
`[m * BLOCK_M, (m + 1) * BLOCK_M)` of sequence `b`, head `h`, and runs an online softmax (fp32, base-2 domain) over
the sequence's keys in tiles of `BLOCK_N`. One launch covers all images of a batch: no per-image host loop.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import fast_kernel, wait_for_inputs

_LOG2E = 1.4426950408889634


@fast_kernel
@triton.jit
def _varlen_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, cu_ptr, stride_qn, stride_qh, stride_kn, stride_kh,
                             stride_vn, stride_vh, stride_on, stride_oh, head_dim, qk_scale,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                             PRECISION: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    m_block = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    start = tl.load(cu_ptr + seq).to(tl.int64)
    length = (tl.load(cu_ptr + seq + 1) - start).to(tl.int32)
    if m_block * BLOCK_M >= length:
        return
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_mask = rows < length
    dim_mask = dims < head_dim
    q_offs = (start + rows)[:, None] * stride_qn + head * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float('-inf'), dtype=tl.float32)
    for col_start in range(0, length, BLOCK_N):
        cols = col_start + tl.arange(0, BLOCK_N)
        col_mask = cols < length
        kv_mask = col_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_ptr + (start + cols)[:, None] * stride_kn + head * stride_kh + dims[None, :], mask=kv_mask,
                    other=0.0)
        v = tl.load(v_ptr + (start + cols)[:, None] * stride_vn + head * stride_vh + dims[None, :], mask=kv_mask,
                    other=0.0)
        qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
        qk = tl.where(col_mask[None, :], qk, float('-inf'))
        # Every tile holds at least one valid key (col_start < length), so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    o_offs = (start + rows)[:, None] * stride_on + head * stride_oh + dims[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                     scale: float) -> torch.Tensor:
    """Attention of q [N, H, D] over k, v [N, H, D] within each packed sequence of `cu_seqlens` [B + 1] (int32 or
    int64, on q's device); returns [N, H, D] in q's dtype."""
    num_rows, num_heads, head_dim = q.shape
    assert k.shape == v.shape == q.shape, f'q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} differ'
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, 'the last dimension must be contiguous'
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    num_seqs = cu_seqlens.numel() - 1
    if num_rows == 0 or num_seqs == 0:
        return out
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m = 64 if block_d <= 128 else 32
    block_n = 64 if block_d <= 64 else 32
    grid = (triton.cdiv(max_seqlen, block_m), num_heads, num_seqs)
    _varlen_attention_kernel[grid](
        q, k, v, out, cu_seqlens, stride_qn=q.stride(0), stride_qh=q.stride(1), stride_kn=k.stride(0),
        stride_kh=k.stride(1), stride_vn=v.stride(0), stride_vh=v.stride(1), stride_on=out.stride(0),
        stride_oh=out.stride(1), head_dim=head_dim, qk_scale=scale * _LOG2E, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=block_d, PRECISION='ieee' if q.dtype == torch.float32 else 'tf32', num_warps=4)
    return out
