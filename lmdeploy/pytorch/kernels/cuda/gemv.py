"""One-row linear, `y = x @ W^T (+ b)` for x [1, K] and W [N, K] (reference: `torch.nn.functional.linear`).

A batch-1 decode step reads every weight once for one row, so its GEMMs are matrix-vector products bound by the
weight read. This kernel streams W once: program `n` owns `BLOCK_N` rows and walks K in `BLOCK_K` steps,
multiplying in fp32 into a `[BLOCK_N, BLOCK_K]` accumulator that is reduced once at the end (no cross-lane
reduction per step). On the H200 (run 34, `docs/benchmarks.md`, `benchmark/bench_decode_gemms.py --gemv-sweep`),
with the sweep's best tiles, it beats cuBLAS's `F.linear` on every one-row weight shape of the real-depth models,
by the most on the narrow and tiny weights (a 64-row weight: 2.4 us against 5.8); the 9B shape's 153 linears a
forward take 4.04 ms against 4.66 (their floor 3.77). `gemv_config` is the rule those best tiles follow.

With programmatic dependent launch (`launch.py`) a program loads its first weight step before it waits for the
previous kernel. The `cuda` backend's `OpType.Linear` runs it for one contiguous half-precision row
(`LMDEPLOY_TRITON_GEMV=0`, read at the backend's import, keeps cuBLAS).

`norm_gemv` is the same GEMV with the RMSNorm before it (and the residual add before that) in its prologue, one
launch instead of two for a decode layer's input and post-attention norms. With s = x + residual (rounded to x's
dtype, the residual stream) and w' the norm scale, the normed row is h = s * rstd * w' with
rstd = rsqrt(mean(s^2) + eps), so y = h @ W^T = rstd * ((s * w') @ W^T): every program streams its rows' weights
against s * w' and the running sum of s^2, and scales by rstd at the end; no program needs the whole row before
it starts. The one difference from the two launches: h enters the dot in float32 rather than rounded to x's dtype
(closer to the float32 reference, within a rounding of the unfused pair). Program 0 also writes the new residual
and, when asked, h rounded to x's dtype (for a second consumer of the normed row, such as the routed experts).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import device_sm_count, fast_kernel, wait_for_inputs


@fast_kernel
@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 PDL: tl.constexpr = False):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    cols = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn + cols[None, :]
    # the first step's weights load before the PDL wait: weights are written at load time, never by the kernel
    # before this one, so their read overlaps that kernel's tail (`launch.py`)
    if EVEN_K:
        w = tl.load(w_ptrs, mask=row_mask[:, None], other=0.0)
    else:
        w = tl.load(w_ptrs, mask=row_mask[:, None] & (cols < K)[None, :], other=0.0)
    wait_for_inputs(PDL)
    x = tl.load(x_ptr + cols, mask=cols < K, other=0.0)
    acc = w.to(tl.float32) * x.to(tl.float32)[None, :]
    w_ptrs += BLOCK_K
    for k in range(BLOCK_K, K, BLOCK_K):
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


@triton.jit
def _norm_input_step(x_ptr, res_ptr, norm_w_ptr, k, cols, K, HAS_RESIDUAL: tl.constexpr,
                     ZERO_CENTERED: tl.constexpr):
    """(s, w') at columns k + cols in float32: s = x + residual rounded to x's dtype (the new residual stream), w'
    the norm scale. Loads only, so the weight loop that calls it stays free of stores and branches."""
    col_mask = k + cols < K
    s = tl.load(x_ptr + k + cols, mask=col_mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + k + cols, mask=col_mask, other=0.0)
        s = (s.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    scale = tl.load(norm_w_ptr + k + cols, mask=col_mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        scale += 1.0
    return s.to(tl.float32), scale


@fast_kernel
@triton.jit
def _norm_gemv_kernel(x_ptr, res_ptr, norm_w_ptr, w_ptr, y_ptr, res_out_ptr, h_out_ptr, N, K, stride_wn, eps,
                      HAS_RESIDUAL: tl.constexpr, STORE_NORMED: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr = False):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    cols = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn + cols[None, :]
    if EVEN_K:  # the first weight step before the PDL wait, as in _gemv_kernel
        w = tl.load(w_ptrs, mask=row_mask[:, None], other=0.0)
    else:
        w = tl.load(w_ptrs, mask=row_mask[:, None] & (cols < K)[None, :], other=0.0)
    wait_for_inputs(PDL)
    s, scale = _norm_input_step(x_ptr, res_ptr, norm_w_ptr, 0, cols, K, HAS_RESIDUAL, ZERO_CENTERED)
    sq = s * s
    acc = w.to(tl.float32) * (s * scale)[None, :]
    w_ptrs += BLOCK_K
    for k in range(BLOCK_K, K, BLOCK_K):
        s, scale = _norm_input_step(x_ptr, res_ptr, norm_w_ptr, k, cols, K, HAS_RESIDUAL, ZERO_CENTERED)
        sq += s * s
        if EVEN_K:
            w = tl.load(w_ptrs, mask=row_mask[:, None], other=0.0)
        else:
            w = tl.load(w_ptrs, mask=row_mask[:, None] & (k + cols < K)[None, :], other=0.0)
        acc += w.to(tl.float32) * (s * scale)[None, :]
        w_ptrs += BLOCK_K
    rstd = tl.rsqrt(tl.sum(sq, 0) / K + eps)
    y = tl.sum(acc, 1) * rstd
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)
    if HAS_RESIDUAL or STORE_NORMED:
        if pid == 0:  # the new residual and the normed row as the norm alone writes it: (s * rstd) * w', rounded
            for k in range(0, K, BLOCK_K):
                col_mask = k + cols < K
                s, scale = _norm_input_step(x_ptr, res_ptr, norm_w_ptr, k, cols, K, HAS_RESIDUAL, ZERO_CENTERED)
                if HAS_RESIDUAL:
                    tl.store(res_out_ptr + k + cols, s.to(res_out_ptr.dtype.element_ty), mask=col_mask)
                if STORE_NORMED:
                    tl.store(h_out_ptr + k + cols, ((s * rstd) * scale).to(h_out_ptr.dtype.element_ty),
                             mask=col_mask)


def gemv_config(n: int, k: int, sms: int) -> dict:
    """Tiles for an [n, k] weight on `sms` SMs, the rule of the H200 sweep's best tiles (run 34): a wide weight (at
    least 64 rows an SM) takes 16 rows x 256 columns a program; a narrower one gives a program the rows of 2048
    columns (one row where k >= 2048, four for k = 512), 512 columns a step, or 1024 columns and 8 warps where the
    whole weight is at most 4M elements (the 64- to 1024-row weights, which need long steps to hide latency)."""
    kp = max(16, triton.next_power_of_2(k))
    if n >= 64 * sms:
        return dict(BLOCK_N=16, BLOCK_K=min(256, kp), num_warps=4)
    small = n * k <= 1 << 22
    return dict(BLOCK_N=max(1, min(16, 2048 // kp)), BLOCK_K=min(1024 if small else 512, kp),
                num_warps=8 if small else 4)


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


def norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
              zero_centered: bool, weight: torch.Tensor, store_normed: bool = False, config: dict | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(`F.linear(h, weight)`, s, h or None) for one row, where s = x + residual (x when residual is None, the
    same tensor) and h = RMSNorm(s) with `norm_weight` (scale 1 + w when `zero_centered`); h is returned only with
    `store_normed`. x and residual [1, K] (or [K]) contiguous, of one dtype; weight [N, K] with unit stride in K.
    See the module docstring for how h enters the dot."""
    k = x.shape[-1]
    assert x.numel() == k and x.is_contiguous(), f'norm_gemv takes one contiguous row, got {tuple(x.shape)}'
    assert residual is None or (residual.shape == x.shape and residual.is_contiguous()
                                and residual.dtype == x.dtype), 'residual must be a contiguous row like x'
    assert norm_weight.shape == (k,) and norm_weight.is_contiguous(), f'norm weight must be [{k}]'
    assert weight.dim() == 2 and weight.size(1) == k and weight.stride(1) == 1, \
        f'weight must be [N, {k}] with contiguous rows, got {tuple(weight.shape)} / {weight.stride()}'
    n = weight.size(0)
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else x
    normed = torch.empty_like(x) if store_normed else None
    cfg = dict(config or gemv_config(n, k, device_sm_count(x.device)))
    _norm_gemv_kernel[(triton.cdiv(max(n, 1), cfg['BLOCK_N']),)](
        x, residual if residual is not None else x, norm_weight, weight, out, res_out,
        normed if normed is not None else out, n, k, weight.stride(0), float(eps), HAS_RESIDUAL=residual is not None,
        STORE_NORMED=store_normed, ZERO_CENTERED=zero_centered, EVEN_K=k % cfg['BLOCK_K'] == 0, **cfg)
    return out, res_out, normed
