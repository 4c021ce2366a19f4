"""Paged causal attention over the packed KV pool: the shared key-block step and the decode kernels (reference:
`kernels/default/paged_attention.py`; the prefill kernels are in `paged_prefill_attention.py`).

Kernels read K/V through `block_tables` ([B, max_pages] kernel-page ids): key `n` of sequence `b` lives in page
`block_tables[b, n // kbs]` at offset `n % kbs` of `k_cache` / `v_cache` ([num_pages, kbs, Hkv, D], possibly strided
views of the packed pool). Softmax is online (flash attention) in fp32 and the base-2 domain: scores are scaled by
`scale * log2(e)` and exponentiated with `exp2`.

`paged_decode_attention`: one query per sequence, flash-decoding. Stage 1, program `(b, kv_head, s)`, runs all
`Hq / Hkv` query heads of a GQA group against split `s` of the keys; stage 2, program `(b, h)`, merges the splits
by their log-sum-exp. The grid depends only on B, Hkv / Hq and `max_num_splits`, and the split length is computed
on the device from `kv_lens`, so a captured CUDA graph replays for any lengths. A sequence with `kv_len == 0`
(graph padding) gets a zero output. With `gate` (gated attention's output gate, [B, Hq, D], unit stride along D)
the merge returns `out * sigmoid(gate)` rounded as the separate `activation.sigmoid_gate_mul` launch would (the
same code, `activation.sigmoid_gated`): one launch less an attention layer of a decode step.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .activation import sigmoid_gated
from .launch import fast_kernel, wait_for_inputs

LOG2E = 1.4426950408889634
_MAX_GRID_YZ = 65535


@triton.jit
def attend_block(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, table_ptr, start, end, pos, cache_head,
                 stride_cp, stride_co, dims, dim_mask, qk_scale,
                 PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL_BLOCK: tl.constexpr, EVEN_D: tl.constexpr,
                 PRECISION: tl.constexpr):
    """One online-softmax step over keys `[start, start + BLOCK_N)`, reading only keys `< end`.

    `IS_CAUSAL_BLOCK`: mask keys `>= end` and keys after each row's position `pos`; otherwise every key of the block is
    known to be valid and visible to every row.
    """
    cols = start + tl.arange(0, BLOCK_N)
    if IS_CAUSAL_BLOCK:
        col_mask = cols < end
        pages = tl.load(table_ptr + cols // PAGE_SIZE, mask=col_mask, other=0).to(tl.int64)
        kv_mask = col_mask[:, None] & dim_mask[None, :]
    else:
        pages = tl.load(table_ptr + cols // PAGE_SIZE).to(tl.int64)
        kv_mask = dim_mask[None, :]
    kv_offs = (pages * stride_cp + (cols % PAGE_SIZE) * stride_co + cache_head)[:, None] + dims[None, :]
    if EVEN_D and not IS_CAUSAL_BLOCK:
        k = tl.load(k_cache_ptr + kv_offs)
    else:
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
    qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
    if IS_CAUSAL_BLOCK:
        visible = (cols[None, :] <= pos[:, None]) & col_mask[None, :]
        qk = tl.where(visible, qk, float('-inf'))
    # Invariant: every row has a finite score in the first block it sees, so m_new is finite and no NaN appears.
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if EVEN_D and not IS_CAUSAL_BLOCK:
        v = tl.load(v_cache_ptr + kv_offs)
    else:
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    return acc, l_i, m_new


@fast_kernel
@triton.jit
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, kv_lens_ptr, part_out_ptr, part_lse_ptr,
                         stride_qb, stride_qh, stride_cp, stride_co, stride_ch, stride_bt,
                         stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                         qk_scale, head_dim, num_splits,
                         PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr,
                         PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(kv_lens_ptr + seq).to(tl.int32)
    # Splits are whole BLOCK_N multiples; trailing splits may be empty (the merge kernel derives the same count).
    split_len = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, kv_len)
    if start >= end:
        return

    group_rows = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + group_rows
    head_mask = group_rows < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    io_mask = head_mask[:, None] & dim_mask[None, :]
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=io_mask, other=0.0)
    # Every key of the split precedes the query (position kv_len - 1), so only `cols < end` masks.
    pos = tl.full([BLOCK_H], kv_len, dtype=tl.int32)

    m_i = tl.full([BLOCK_H], float('-inf'), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    table_ptr = block_tables_ptr + seq * stride_bt
    cache_head = kv_head * stride_ch
    for block_start in range(start, end, BLOCK_N):
        acc, l_i, m_i = attend_block(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, table_ptr, block_start, end, pos,
                                     cache_head, stride_cp, stride_co, dims, dim_mask, qk_scale,
                                     PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N, IS_CAUSAL_BLOCK=True, EVEN_D=EVEN_D,
                                     PRECISION=PRECISION)

    part_offs = seq * stride_pb + heads[:, None] * stride_ph + split * stride_ps + dims[None, :]
    tl.store(part_out_ptr + part_offs, acc / l_i[:, None], mask=io_mask)
    lse = m_i + tl.log2(l_i)
    tl.store(part_lse_ptr + seq * stride_lb + heads * stride_lh + split, lse, mask=head_mask)


@fast_kernel
@triton.jit
def _decode_merge_kernel(part_out_ptr, part_lse_ptr, o_ptr, kv_lens_ptr, gate_ptr,
                         stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
                         stride_gb, stride_gh, head_dim, num_splits,
                         BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         HAS_GATE: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    kv_len = tl.load(kv_lens_ptr + seq).to(tl.int32)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    o_ptrs = o_ptr + seq * stride_ob + head * stride_oh + dims
    if kv_len <= 0:
        tl.store(o_ptrs, tl.zeros([BLOCK_D], dtype=tl.float32).to(o_ptr.dtype.element_ty), mask=dim_mask)
        return
    split_len = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    num_active = tl.cdiv(kv_len, split_len)
    splits = tl.arange(0, BLOCK_S)
    split_mask = splits < num_active
    lse = tl.load(part_lse_ptr + seq * stride_lb + head * stride_lh + splits, mask=split_mask, other=float('-inf'))
    weights = tl.exp2(lse - tl.max(lse, 0))
    part_offs = seq * stride_pb + head * stride_ph + splits[:, None] * stride_ps + dims[None, :]
    parts = tl.load(part_out_ptr + part_offs, mask=split_mask[:, None] & dim_mask[None, :], other=0.0)
    out = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    if HAS_GATE:
        gate = tl.load(gate_ptr + seq * stride_gb + head * stride_gh + dims, mask=dim_mask, other=0.0)
        tl.store(o_ptrs, sigmoid_gated(out, gate.to(tl.float32), o_ptr.dtype.element_ty), mask=dim_mask)
    else:
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=dim_mask)


def check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                batch_size: int) -> None:
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride(), \
        'k_cache and v_cache must be [P, kbs, Hkv, D] views of one layout'
    num_heads, head_dim = q.shape[1:]
    assert k_cache.size(3) == head_dim, f'cache head_dim {k_cache.size(3)} != query head_dim {head_dim}'
    assert num_heads % k_cache.size(2) == 0, f'Hq {num_heads} is not a multiple of Hkv {k_cache.size(2)}'
    assert q.stride(2) == 1 and k_cache.stride(3) == 1, 'head_dim must be contiguous'
    assert block_tables.dim() == 2 and block_tables.size(0) == batch_size and block_tables.stride(1) == 1, \
        f'block_tables must be [B={batch_size}, max_pages] with contiguous rows, got {tuple(block_tables.shape)}'
    assert batch_size <= _MAX_GRID_YZ, f'batch of {batch_size} sequences exceeds the grid limit'


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs keep full precision (tf32 would cost ~1e-3 relative error); half types ignore the setting.
    return 'ieee' if dtype == torch.float32 else 'tf32'


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           kv_lens: torch.Tensor, scale: float, max_num_splits: int = 16,
                           gate: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence (`q` [B, Hq, D], at position `kv_lens[b] - 1`) over its paged K/V: [B, Hq, D]; times
    sigmoid(`gate`) ([B, Hq, D], unit stride along D) when given (see the module docstring).

    Two launches whose grids depend only on shapes and `max_num_splits`: no host sync, CUDA-graph safe.
    """
    assert q.dim() == 3, f'q must be [B, Hq, D], got {tuple(q.shape)}'
    batch_size, num_heads, head_dim = q.shape
    check_cache(q, k_cache, v_cache, block_tables, batch_size)
    assert kv_lens.shape == (batch_size,) and max_num_splits >= 1
    assert gate is None or (gate.shape == q.shape and gate.dtype == q.dtype and gate.stride(2) == 1), \
        f'gate must be [B, Hq, D] of q\'s dtype with unit stride along D, got {tuple(gate.shape)}'
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch_size == 0:
        return out
    num_kv_heads = k_cache.size(2)
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = 64 if block_d <= 128 else 32
    part_out = torch.empty(batch_size, num_heads, max_num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch_size, num_heads, max_num_splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch_size, num_kv_heads, max_num_splits)](
        q_ptr=q, k_cache_ptr=k_cache, v_cache_ptr=v_cache, block_tables_ptr=block_tables, kv_lens_ptr=kv_lens,
        part_out_ptr=part_out, part_lse_ptr=part_lse,
        stride_qb=q.stride(0), stride_qh=q.stride(1),
        stride_cp=k_cache.stride(0), stride_co=k_cache.stride(1), stride_ch=k_cache.stride(2),
        stride_bt=block_tables.stride(0),
        stride_pb=part_out.stride(0), stride_ph=part_out.stride(1), stride_ps=part_out.stride(2),
        stride_lb=part_lse.stride(0), stride_lh=part_lse.stride(1),
        qk_scale=scale * LOG2E, PAGE_SIZE=k_cache.size(1), head_dim=head_dim, num_splits=max_num_splits,
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        EVEN_D=block_d == head_dim, PRECISION=dot_precision(q.dtype), num_warps=4, num_stages=2)
    _decode_merge_kernel[(batch_size, num_heads)](
        part_out_ptr=part_out, part_lse_ptr=part_lse, o_ptr=out, kv_lens_ptr=kv_lens,
        gate_ptr=gate if gate is not None else out,
        stride_pb=part_out.stride(0), stride_ph=part_out.stride(1), stride_ps=part_out.stride(2),
        stride_lb=part_lse.stride(0), stride_lh=part_lse.stride(1),
        stride_ob=out.stride(0), stride_oh=out.stride(1),
        stride_gb=gate.stride(0) if gate is not None else 0, stride_gh=gate.stride(1) if gate is not None else 0,
        head_dim=head_dim, num_splits=max_num_splits,
        BLOCK_S=triton.next_power_of_2(max_num_splits), BLOCK_N=block_n, BLOCK_D=block_d, HAS_GATE=gate is not None,
        num_warps=4)
    return out
