"""One-row linear, `y = x @ W^T (+ b)` for x [1, K] and W [N, K] (reference: `torch.nn.functional.linear`).

A batch-1 decode step reads every weight once for one row, so its GEMMs are matrix-vector products bound by the
weight read. cuBLAS reaches 83-86% of the H200's copy rate on the 9B shape's large projections and 40-76% on the
MoE shapes' (2048-wide) ones, and a tiny weight costs it ~4-5 us whatever its bytes (`docs/benchmarks.md`,
`benchmark/bench_decode_gemms.py`). This kernel streams W once: program `n` owns `BLOCK_N` rows and walks K in
`BLOCK_K` steps, multiplying in fp32 into a `[BLOCK_N, BLOCK_K]` accumulator that is reduced once at the end (no
cross-lane reduction per step). `BLOCK_N` is the largest power of two (at most 16) that still leaves two programs
per SM, so narrow weights (N of a few thousand rows) keep the GPU busy.

Opt-in (`LMDEPLOY_TRITON_GEMV=1`, read at the backend's import): not yet timed against cuBLAS on a GPU
(`bench_decode_gemms.py` has the column); the backend uses it for one-row half-precision inputs only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import device_sm_count, fast_kernel


@fast_kernel
@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    cols = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn + cols[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptr + k + cols)
            w = tl.load(w_ptrs, mask=row_mask[:, None], other=0.0)
        else:
            col_mask = k + cols < K
            x = tl.load(x_ptr + k + cols, mask=col_mask, other=0.0)
            w = tl.load(w_ptrs, mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)


def gemv_config(n: int, k: int, sms: int) -> dict:
    """Tiles for an [n, k] weight: `BLOCK_N` rows a program (a power of two in [1, 16], at least two programs per
    SM where n allows), `BLOCK_K` columns a step (512, or k's power of two if smaller)."""
    block_n = 16
    while block_n > 1 and triton.cdiv(n, block_n) < 2 * sms:
        block_n //= 2
    block_k = min(512, max(16, triton.next_power_of_2(k)))
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: dict | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for one row: x [1, K] (or [K]) contiguous, weight [N, K] with unit stride in K;
    returns [1, N] (or [N]) in x's dtype. `config`: `gemv_config`'s keys, for benchmarks."""
    k = x.shape[-1]
    assert x.numel() == k and x.is_contiguous(), f'gemv takes one contiguous row, got {tuple(x.shape)}'
    assert weight.dim() == 2 and weight.size(1) == k and weight.stride(1) == 1, \
        f'weight must be [N, {k}] with contiguous rows, got {tuple(weight.shape)} / {weight.stride()}'
    n = weight.size(0)
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    cfg = dict(config or gemv_config(n, k, device_sm_count(x.device)))
    _gemv_kernel[(triton.cdiv(n, cfg['BLOCK_N']),)](
        x, weight, bias if bias is not None else out, out, n, k, weight.stride(0), HAS_BIAS=bias is not None,
        EVEN_K=k % cfg['BLOCK_K'] == 0, **cfg)
    return out
