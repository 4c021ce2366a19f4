"""Triton block-wise FP8 GEMM (W8A8) and per-token-group activation quantization; semantics of
`kernels/default/blocked_fp8.py` (the torch reference).

`quant_fp8`: one program per (row, group of `group_size` channels): scale = max(amax, 1e-10) / 448, q = x / scale.

`blocked_gemm_fp8`: C[M, N] = sum over K blocks of (A_blk @ B_blk^T) * a_scale[m, kb] * b_scale[n // bn, kb], with
BLOCK_K = bk (one scale per operand row per K step) and float32 accumulation; each program owns a BLOCK_M x BLOCK_N
output tile and loads the weight scales of its columns once per K step. Edge tiles are masked (zeros add nothing).
The tile (BLOCK_M, BLOCK_N, warps, stages) is autotuned among `GEMM_TILES` per (N, K, row bucket, dtypes);
`tune_blocked_gemm_fp8` runs that tuning at engine start-up for the model's shapes (a first forward or a CUDA graph
capture then only looks the tile up). The interpreter and `LMDEPLOY_FP8_AUTOTUNE=0` take `fixed_tile`.

`torch_scaled_mm_blocked` is the alternative through torch's `_scaled_mm` with 1x128 / 128x128 block scales
(cuBLAS, Hopper): which layouts it accepts differs between torch versions, so it is probed once against the
reference and used only if one matches. `LMDEPLOY_FP8_GEMM=triton|torch` picks (default triton until the H200
benchmark, `benchmark/bench_fp8_gemm.py`, says otherwise).
"""
from __future__ import annotations

import functools
import inspect
import os

import torch
import triton
import triton.language as tl

from .launch import fast_kernel, wait_for_inputs

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max


@fast_kernel
@triton.jit
def _quant_fp8_kernel(x_ptr, q_ptr, s_ptr, cols, stride_x, stride_q, stride_s, GROUP: tl.constexpr,
                      BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    offs = group * GROUP + tl.arange(0, BLOCK)
    mask = (tl.arange(0, BLOCK) < GROUP) & (offs < cols)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-10) / FP8_MAX
    q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_s + group, scale)


def quant_fp8(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (FP8 [M, K], float32 scales [M, ceil(K / group_size)])."""
    assert x.dim() == 2 and x.stride(-1) == 1, f'bad activation {tuple(x.shape)} / {x.stride()}'
    rows, cols = x.shape
    groups = triton.cdiv(cols, group_size)
    q = torch.empty(rows, cols, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    if rows:
        _quant_fp8_kernel[(rows, groups)](x, q, scale, cols, stride_x=x.stride(0), stride_q=q.stride(0),
                                          stride_s=scale.stride(0), GROUP=group_size,
                                          BLOCK=triton.next_power_of_2(group_size), FP8_MAX=FP8_MAX)
    return q, scale


@triton.jit(do_not_specialize=['M', 'M_BUCKET'])  # one compiled kernel per tile for every row count
def _blocked_gemm_fp8(a_ptr, a_s_ptr, b_ptr, b_s_ptr, c_ptr, M, N, K, M_BUCKET, stride_am, stride_asm, stride_bn,
                      stride_bsn, stride_cm, BLOCK_SIZE_N: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # M_BUCKET (`m_bucket(M)`) is only the autotuning key: every M of a bucket runs the bucket's tuned tile
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + cols.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]
    a_s_ptrs = a_s_ptr + rows.to(tl.int64) * stride_asm
    b_s_ptrs = b_s_ptr + (cols // BLOCK_SIZE_N).to(tl.int64) * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        a_s = tl.load(a_s_ptrs + kb, mask=row_mask, other=0.0)
        b_s = tl.load(b_s_ptrs + kb, mask=col_mask, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


# ---- tile configs and autotuning ----------------------------------------------------------------------------------
# (BLOCK_M, BLOCK_N, num_warps, num_stages) for Hopper; BLOCK_K is always the weight's bk, so each K step reads one
# scale per operand row. Small row tiles serve decode, 128x128 with 8 warps large prefills.
GEMM_TILES = ((16, 64, 4, 3), (16, 64, 4, 4), (16, 128, 4, 3), (16, 128, 4, 4),
              (32, 64, 4, 3), (32, 128, 4, 4),
              (64, 64, 4, 3), (64, 128, 4, 4), (64, 128, 8, 3),
              (128, 64, 4, 3), (128, 128, 8, 3), (128, 128, 8, 4))
# Row-count buckets the tuning is keyed on: a decode batch of 1-16 rows tunes once, a prefill chunk past 1024 rows
# takes the 4096 bucket's tile.
M_BUCKETS = (16, 32, 64, 128, 256, 1024, 4096)
# `LMDEPLOY_FP8_AUTOTUNE=0` keeps the fixed tiles of `fixed_tile` (the choice before autotuning); the Triton
# interpreter always does (it cannot time configs).
AUTOTUNE = os.environ.get('LMDEPLOY_FP8_AUTOTUNE', '1') != '0' and os.environ.get('TRITON_INTERPRET') != '1'


def m_bucket(rows: int) -> int:
    """The smallest bucket of `M_BUCKETS` holding `rows` (the largest for more rows)."""
    return next((bucket for bucket in M_BUCKETS if rows <= bucket), M_BUCKETS[-1])


def tiles_for_bucket(bucket: int) -> list[tuple[int, int, int, int]]:
    """The tiles worth timing for a row bucket: no row tile taller than the bucket (the rows past M are masked
    work), and no tile under 64 rows once a bucket has 256 or more (too many programs re-reading the weight)."""
    return [t for t in GEMM_TILES if t[0] <= bucket and (bucket < 256 or t[0] >= 64)]


def fixed_tile(rows: int) -> tuple[int, int, int, int]:
    """The tile without autotuning: small row tiles for decode, larger ones for prefill."""
    if rows <= 16:
        return 16, 64, 4, 3
    if rows <= 64:
        return 64, 64, 4, 3
    return 128, 128, 8, 3


def _prune_tiles(configs, named_args, **kwargs):
    bucket = {**named_args, **kwargs}['M_BUCKET']
    keep = set(tiles_for_bucket(bucket))
    return [c for c in configs if (c.kwargs['BLOCK_M'], c.kwargs['BLOCK_N'], c.num_warps, c.num_stages) in keep]


def _quick_bench(fn, quantiles):
    """Autotuning times each config for ~25 ms, not Triton's default ~125 ms: start-up pays this per shape."""
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


def _autotune_options() -> dict:
    """`cache_results` keeps the tuned tiles in Triton's on-disk cache (a warm start skips the timing), where this
    Triton has it."""
    params = inspect.signature(triton.autotune).parameters
    return {name: value for name, value in (('do_bench', _quick_bench), ('cache_results', True)) if name in params}


# Launches with an explicit tile take the cheap path (`launch.fast_kernel`); the autotuner only chooses a key's tile
# once (it times the tiles and runs the best), then `_TUNED` holds the choice and later calls launch it directly.
_blocked_gemm_fp8_kernel = fast_kernel(_blocked_gemm_fp8)
_tuned_gemm_fp8_kernel = triton.autotune(
    configs=[triton.Config({'BLOCK_M': m, 'BLOCK_N': n}, num_warps=w, num_stages=s) for m, n, w, s in GEMM_TILES],
    key=['N', 'K', 'M_BUCKET', 'BLOCK_SIZE_N', 'BLOCK_K'], prune_configs_by={'early_config_prune': _prune_tiles},
    **_autotune_options())(_blocked_gemm_fp8)
# (N, K, row bucket, block_size, out dtype) -> the tuned (BLOCK_M, BLOCK_N, num_warps, num_stages)
_TUNED: dict[tuple, tuple[int, int, int, int]] = {}


def tuned_tile(cols: int, depth: int, rows: int, block_size: tuple[int, int], out_dtype: torch.dtype
               ) -> tuple[int, int, int, int] | None:
    """The autotuner's tile for this GEMM key, or None before it is tuned."""
    return _TUNED.get((cols, depth, m_bucket(rows), tuple(block_size), out_dtype))


def blocked_gemm_fp8(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                     block_size: tuple[int, int], out_dtype: torch.dtype,
                     tile: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """a [M, K] FP8 (scales [M, ceil(K / bk)]) @ b [N, K] FP8 (scales [ceil(N / bn), ceil(K / bk)])^T -> [M, N].

    The tile is autotuned per (N, K, `m_bucket(M)`, dtypes) at the first call of each key (`tune_blocked_gemm_fp8`
    does that at start-up); `tile` (BLOCK_M, BLOCK_N, num_warps, num_stages) forces one, and with autotuning off
    (`AUTOTUNE`) it is `fixed_tile(M)`."""
    rows, depth = a.shape
    cols = b.shape[0]
    block_n, block_k = block_size
    assert b.shape[1] == depth and a.stride(-1) == 1 and b.stride(-1) == 1, 'bad FP8 operands'
    assert a_scale.shape == (rows, triton.cdiv(depth, block_k)), f'bad a_scale {tuple(a_scale.shape)}'
    assert b_scale.shape == (triton.cdiv(cols, block_n), triton.cdiv(depth, block_k)), \
        f'bad b_scale {tuple(b_scale.shape)}'
    out = torch.empty(rows, cols, dtype=out_dtype, device=a.device)
    if rows == 0:
        return out
    args = dict(M=rows, N=cols, K=depth, M_BUCKET=m_bucket(rows), stride_am=a.stride(0),
                stride_asm=a_scale.stride(0), stride_bn=b.stride(0), stride_bsn=b_scale.stride(0),
                stride_cm=out.stride(0), BLOCK_SIZE_N=block_n, BLOCK_K=block_k)
    if tile is None and AUTOTUNE:
        key = (cols, depth, m_bucket(rows), (block_n, block_k), out_dtype)
        tile = _TUNED.get(key)
        if tile is None:  # first call of this key: time the tiles (the tuner runs the best one on these operands)
            grid = lambda meta: (triton.cdiv(rows, meta['BLOCK_M']), triton.cdiv(cols, meta['BLOCK_N']))  # noqa: E731
            _tuned_gemm_fp8_kernel[grid](a, a_scale, b, b_scale, out, **args)
            best = _tuned_gemm_fp8_kernel.best_config
            _TUNED[key] = (best.kwargs['BLOCK_M'], best.kwargs['BLOCK_N'], best.num_warps, best.num_stages)
            return out
    block_m, tile_n, num_warps, num_stages = tile or fixed_tile(rows)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(cols, tile_n))
    _blocked_gemm_fp8_kernel[grid](a, a_scale, b, b_scale, out, **args, BLOCK_M=block_m, BLOCK_N=tile_n,
                                   num_warps=num_warps, num_stages=num_stages)
    return out


def tune_blocked_gemm_fp8(shapes: set[tuple[int, int, tuple[int, int]]], max_rows: int, out_dtype: torch.dtype,
                          device: torch.device) -> int:
    """Autotune the GEMM now for every (N, K, block_size) of `shapes` and every row bucket up to `m_bucket(max_rows)`,
    so no request's forward (and no CUDA graph capture) pays for it. Returns the number of keys run (0 with
    autotuning off). A key times up to 12 tiles for ~25 ms each, and each tile compiles once per process (the
    compiled kernels, and with `cache_results` the chosen tiles, stay in Triton's on-disk cache for a warm start)."""
    if not AUTOTUNE or not shapes:
        return 0
    buckets = [b for b in M_BUCKETS if b <= m_bucket(max_rows)]
    gen = torch.Generator(device=device).manual_seed(0)
    count = 0
    for cols, depth, (block_n, block_k) in sorted(shapes):
        b = torch.randn(cols, depth, device=device, generator=gen).to(FP8_DTYPE)
        b_scale = torch.ones(triton.cdiv(cols, block_n), triton.cdiv(depth, block_k), device=device)
        for rows in buckets:
            a = torch.randn(rows, depth, device=device, generator=gen).to(FP8_DTYPE)
            a_scale = torch.ones(rows, triton.cdiv(depth, block_k), device=device)
            blocked_gemm_fp8(a, a_scale, b, b_scale, (block_n, block_k), out_dtype)
            count += 1
    return count


# ---- torch._scaled_mm with block scales ---------------------------------------------------------------------------
def _scaled_mm_variants(a, a_scale, b, b_scale, out_dtype):
    """Layouts torch versions have asked for: 1x128 activation scales outer-dim-major (column-major [M, K/128]),
    128x128 weight scales as [N/128, K/128] or transposed."""
    a_s = a_scale.t().contiguous().t()
    yield lambda: torch._scaled_mm(a, b.t(), scale_a=a_s, scale_b=b_scale.t(), out_dtype=out_dtype)
    yield lambda: torch._scaled_mm(a, b.t(), scale_a=a_s, scale_b=b_scale, out_dtype=out_dtype)
    yield lambda: torch._scaled_mm(a, b.t(), scale_a=a_s, scale_b=b_scale.t().contiguous(), out_dtype=out_dtype)


# (rows, depth, cols) the probe checks: one token, an odd number of K blocks, a batch that fills no tile evenly.
# On the H200 (torch 2.11) a layout that passed a single 64x512x256 probe gave wrong results (inf) at one token and
# CUBLAS_STATUS_NOT_SUPPORTED at K = 2176, so a layout must match the reference on every one of these.
_PROBE_SHAPES = ((64, 512, 256), (1, 2048, 2048), (300, 2176, 640))


@functools.cache
def _scaled_mm_variant(device_index: int) -> int | None:
    """Index of the first `_scaled_mm` layout that matches the reference on this device at every probe shape, or
    None (then the Triton kernel serves every FP8 GEMM)."""
    from ..default.blocked_fp8 import blocked_gemm_fp8 as reference
    gen = torch.Generator(device=f'cuda:{device_index}').manual_seed(0)
    device = torch.device('cuda', device_index)
    f32 = torch.float32
    cases = []
    for rows, depth, cols in _PROBE_SHAPES:
        a = torch.randn(rows, depth, device=device, generator=gen, dtype=f32)
        b = (torch.randn(cols, depth, device=device, generator=gen, dtype=f32) * 0.05).to(FP8_DTYPE)
        b_scale = torch.rand(-(-cols // 128), -(-depth // 128), device=device, generator=gen, dtype=f32) + 0.5
        aq, a_scale = quant_fp8(a, 128)
        cases.append((aq, a_scale, b, b_scale, reference(aq, a_scale, b, b_scale, (128, 128), torch.bfloat16).float()))
    num_variants = len(list(_scaled_mm_variants(*cases[0][:4], torch.bfloat16)))
    for index in range(num_variants):
        if all(_variant_matches(index, case) for case in cases):
            return index
    return None


def _variant_matches(index: int, case) -> bool:
    aq, a_scale, b, b_scale, expected = case
    try:
        got = list(_scaled_mm_variants(aq, a_scale, b, b_scale, torch.bfloat16))[index]().float()
    except (RuntimeError, TypeError, ValueError):
        return False
    return bool(torch.isfinite(got).all()) and torch.allclose(got, expected, atol=2e-2, rtol=2e-2)


def torch_scaled_mm_supported(device: torch.device) -> bool:
    return device.type == 'cuda' and _scaled_mm_variant(device.index or 0) is not None


def torch_scaled_mm_blocked(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                            out_dtype: torch.dtype) -> torch.Tensor:
    """`blocked_gemm_fp8` through torch for 128x128 blocks; raises if no layout works here."""
    variant = _scaled_mm_variant(a.device.index or 0)
    if variant is None:
        raise RuntimeError('torch._scaled_mm has no block-wise FP8 layout that matches the reference here')
    return list(_scaled_mm_variants(a, a_scale, b, b_scale, out_dtype))[variant]()


def use_torch_scaled_mm(block_size: tuple[int, int]) -> bool:
    """Whether FP8 linears take torch's `_scaled_mm`: asked for (`LMDEPLOY_FP8_GEMM=torch`), 128x128 blocks, and a
    layout that matches the reference on the current device (probed once; call at construction, never inside a
    CUDA graph capture)."""
    return (os.environ.get('LMDEPLOY_FP8_GEMM', 'triton') == 'torch' and tuple(block_size) == (128, 128)
            and torch.cuda.is_available()
            and torch_scaled_mm_supported(torch.device('cuda', torch.cuda.current_device())))


def linear_blocked_fp8(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                       bias: torch.Tensor | None, block_size: tuple[int, int], use_torch: bool = False,
                       tile: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """y = x W^T (+ b) with an FP8 weight; x [..., K] bf16 / fp16, y in x's dtype. `use_torch`: the GEMM through
    `torch_scaled_mm_blocked` (see `use_torch_scaled_mm`); `tile`: see `blocked_gemm_fp8`."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    q, scale = quant_fp8(rows, block_size[1])
    if use_torch:
        out = torch_scaled_mm_blocked(q, scale, weight, weight_scale_inv, x.dtype)
    else:
        out = blocked_gemm_fp8(q, scale, weight, weight_scale_inv, block_size, x.dtype, tile=tile)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])
