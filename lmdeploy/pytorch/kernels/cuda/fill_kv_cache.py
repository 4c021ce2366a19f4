"""Write new tokens' K and V into the paged pool in one launch (reference: `kernels/default/paged_attention.py`).

`k_cache` / `v_cache` are `[num_pages, kernel_block_size, num_kv_heads, head_dim]` views that may be strided (the
packed pool interleaves K and V pages, so the page stride is `2 * kbs * H * D` elements); both must share one
layout. Program `(t, h)` copies heads `[h * BLOCK_H, (h + 1) * BLOCK_H)` of token `t`, K and V both, to
`slot_mapping[t] = page * kbs + offset`. A negative slot (padding rows of a captured CUDA graph) writes nothing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import fast_kernel, wait_for_inputs

# Elements of one K (or V) tile a program moves; V doubles it.
_TILE_ELEMS = 4096
_MAX_GRID_Y = 65535


@fast_kernel
@triton.jit
def _fill_kv_cache_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                          stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_cp, stride_co, stride_ch,
                          page_size, num_heads, head_dim,
                          BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    tok = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    page = slot // page_size
    offset = slot % page_size
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < head_dim)
    k = tl.load(k_ptr + tok * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    dst = page * stride_cp + offset * stride_co + heads[:, None] * stride_ch + dims[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def fill_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Write `k`, `v` ([T, H, D]) into the caches at `slot_mapping` ([T], page * kbs + offset)."""
    assert k.dim() == 3 and k.shape == v.shape, f'k {tuple(k.shape)} and v {tuple(v.shape)} must be [T, H, D]'
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride(), \
        'k_cache and v_cache must be [P, kbs, H, D] views of one layout'
    num_tokens, num_heads, head_dim = k.shape
    assert tuple(k_cache.shape[2:]) == (num_heads, head_dim), \
        f'cache heads/dim {tuple(k_cache.shape[2:])} != {(num_heads, head_dim)}'
    assert slot_mapping.shape == (num_tokens,) and not slot_mapping.is_floating_point()
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(3) == 1, 'head_dim must be contiguous'
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_heads), max(1, _TILE_ELEMS // block_d))
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    assert grid[1] <= _MAX_GRID_Y
    _fill_kv_cache_kernel[grid](
        k_ptr=k, v_ptr=v, k_cache_ptr=k_cache, v_cache_ptr=v_cache, slot_ptr=slot_mapping.contiguous(),
        stride_kt=k.stride(0), stride_kh=k.stride(1), stride_vt=v.stride(0), stride_vh=v.stride(1),
        stride_cp=k_cache.stride(0), stride_co=k_cache.stride(1), stride_ch=k_cache.stride(2),
        page_size=k_cache.size(1), num_heads=num_heads, head_dim=head_dim,
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4)
