"""Triton segmented LoRA (SGMV-style); semantics and weight layout of `kernels/default/lora.py`.

The batch is packed varlen: sequence b owns tokens `[cu_seqlens[b], cu_seqlens[b + 1])` and one adapter slot
`seq_slots[b]` (0 = base model). Each program owns one sequence's tile of `BLOCK_M` tokens:

1. Shrink: program (b, token tile, rank tile) computes `y = x A[slot]^T` for its tile, `y [T, n * R]`.
2. Expand, once per output slice i: program (b, token tile, column tile) adds
   `y[:, i R:(i + 1) R] B_i[slot]^T` to its tile of `out`, in place (every element of `out` has exactly one owner,
   so no atomics).

Both are the same segmented tile GEMM (`_sgmv_kernel`); the expand adds to its output (`ACCUMULATE`).

Programs of base-model sequences (slot 0) and of tiles past their sequence's end exit at once, and they never
write: shrink rows of base sequences are left unwritten because no expand reads them. Grid sizes come from host
shapes and `max_seqlen`, so launches never synchronise and replay inside CUDA graphs (where `max_seqlen` is the
graph's bound). Accumulation is float32; `y` is rounded to x's dtype like the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import fast_kernel, wait_for_inputs


@fast_kernel
@triton.jit
def _sgmv_kernel(x_ptr, w_ptr, out_ptr, seq_slots_ptr, cu_seqlens_ptr, depth, width, stride_xt, stride_ws,
                 stride_wn, stride_ot, ACCUMULATE: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """out[rows, cols] (+)= x[rows, :depth] W[slot][cols, :depth]^T for one sequence's token tile and column tile:
    the shrink (W = A, out = y, stored) and each expand slice (W = B_i, x = y_i, added to out)."""
    wait_for_inputs(PDL)
    seq = tl.program_id(0)
    slot = tl.load(seq_slots_ptr + seq).to(tl.int64)
    start = tl.load(cu_seqlens_ptr + seq)
    end = tl.load(cu_seqlens_ptr + seq + 1)
    first = start + tl.program_id(1) * BLOCK_M
    if slot == 0 or first >= end:
        return
    rows = first + tl.arange(0, BLOCK_M)
    row_mask = rows < end
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < width
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xt + offs_k[None, :]
    w_ptrs = w_ptr + slot * stride_ws + cols[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, depth, BLOCK_K):
        k_mask = offs_k < depth - k0
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_ot + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    if ACCUMULATE:
        acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _block_m(max_seqlen: int) -> int:
    return 16 if max_seqlen <= 16 else 32 if max_seqlen <= 64 else 64


def sgmv_lora(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
              slice_sizes: list[int], seq_slots: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int
              ) -> torch.Tensor:
    """Add each sequence's LoRA delta to `out` [T, out] in place and return it.

    x [T, in]; lora_a [S, n * R, in]; lora_b [S, out, R] (both with unit stride in the last dimension);
    seq_slots [B] int64; cu_seqlens [B + 1] int64; `max_seqlen` bounds every sequence's token count.
    """
    num_tokens, in_features = x.shape
    num_slots, stacked_rank, _ = lora_a.shape
    rank = stacked_rank // len(slice_sizes)
    assert lora_a.shape == (num_slots, len(slice_sizes) * rank, in_features), f'bad lora_a {tuple(lora_a.shape)}'
    assert lora_b.shape == (num_slots, sum(slice_sizes), rank), f'bad lora_b {tuple(lora_b.shape)}'
    assert out.shape == (num_tokens, sum(slice_sizes)) and out.stride(-1) == 1, 'out must be [T, out], row-major'
    assert lora_a.stride(-1) == 1 and lora_b.stride(-1) == 1
    num_seqs = seq_slots.numel()
    if num_tokens == 0 or num_seqs == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    precision = 'ieee' if x.dtype == torch.float32 else 'tf32'
    block_m = _block_m(max_seqlen)
    tiles = triton.cdiv(max_seqlen, block_m)
    y = torch.empty(num_tokens, stacked_rank, dtype=x.dtype, device=x.device)
    block_n = 16 if stacked_rank <= 16 else 32 if stacked_rank <= 32 else 64
    _sgmv_kernel[(num_seqs, tiles, triton.cdiv(stacked_rank, block_n))](
        x, lora_a, y, seq_slots, cu_seqlens, depth=in_features, width=stacked_rank, stride_xt=x.stride(0),
        stride_ws=lora_a.stride(0), stride_wn=lora_a.stride(1), stride_ot=y.stride(0), ACCUMULATE=False,
        PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64, num_warps=4)
    start = 0
    for i, size in enumerate(slice_sizes):
        y_i, b_i, out_i = y[:, i * rank:(i + 1) * rank], lora_b[:, start:start + size], out[:, start:start + size]
        _sgmv_kernel[(num_seqs, tiles, triton.cdiv(size, 64))](
            y_i, b_i, out_i, seq_slots, cu_seqlens, depth=rank, width=size, stride_xt=y_i.stride(0),
            stride_ws=b_i.stride(0), stride_wn=b_i.stride(1), stride_ot=out_i.stride(0), ACCUMULATE=True,
            PRECISION=precision, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=16, num_warps=4)
        start += size
    return out
