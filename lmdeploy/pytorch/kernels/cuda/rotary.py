"""Triton neox-style rotary embedding with partial rotary; semantics of `backends/default/elementwise.py`.

One launch covers q and k: program (token, head) with head < Hq rotating a q head and the rest k heads. Feature
d < R (R = cos.size(-1), even, <= head_dim) becomes ``x[d] * cos[d] + sign(d) * x[partner(d)] * sin[d]`` with
partner/sign = (d + R/2, -1) in the first half and (d - R/2, +1) in the second; features d >= R pass through.
Math in float32; outputs are new contiguous tensors in the inputs' dtypes.

`rotary_fill_kv_cache` fuses the attention layer's rotary with its KV-cache fill (`fill_kv_cache.py`): programs of
k heads write the rotated K (rounded to k's dtype, then cast to the cache's, as the unfused pair does) and V
straight into the paged pool at `slot_mapping` (negative slots write nothing), so the rotated K never exists as a
tensor; programs of q heads write the rotated query as `apply_rotary` does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import fast_kernel, wait_for_inputs


@triton.jit
def _head_layout(head_dim, ROTARY_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """Feature offsets of one head, which are in the head, which rotate, which are in the first half, and each
    one's partner (d + R/2 in the first half, d - R/2 in the second)."""
    offs = tl.arange(0, BLOCK)
    half = ROTARY_DIM // 2
    first = offs < half
    return offs, offs < head_dim, offs < ROTARY_DIM, first, tl.where(first, offs + half, offs - half)


@triton.jit
def _rope(x, x_partner, cos_ptr, sin_ptr, offs, is_rot, first):
    """`x * cos + sign * x_partner * sin` on the rotating features (float32), `x` on the rest."""
    cos = tl.load(cos_ptr + offs, mask=is_rot, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + offs, mask=is_rot, other=0.0).to(tl.float32)
    rotated = tl.where(first, -x_partner, x_partner)
    return tl.where(is_rot, x * cos + rotated * sin, x)


@triton.jit
def _rotated(x_ptr, cos_ptr, sin_ptr, head_dim, ROTARY_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """One head rotated, in float32 ([BLOCK], features >= head_dim are 0)."""
    offs, mask, is_rot, first, partner = _head_layout(head_dim, ROTARY_DIM, BLOCK)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(x_ptr + partner, mask=is_rot, other=0.0).to(tl.float32)
    return _rope(x, x_partner, cos_ptr, sin_ptr, offs, is_rot, first)


@triton.jit
def _normed_rotated(x_ptr, w_ptr, cos_ptr, sin_ptr, head_dim, eps, ZERO_CENTERED: tl.constexpr,
                    ROTARY_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """One head RMS-normalised (float32, scaled by w or 1 + w, rounded to x's dtype as the norm kernel's output
    is), then rotated: `_rotated` of `rms_norm(x)`. The norm's scale is one scalar per head, so the partner
    features are normalised on their own load."""
    offs, mask, is_rot, first, partner = _head_layout(head_dim, ROTARY_DIM, BLOCK)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / head_dim + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w_partner = tl.load(w_ptr + partner, mask=is_rot, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
        w_partner = w_partner + 1.0
    x_partner = tl.load(x_ptr + partner, mask=is_rot, other=0.0).to(tl.float32)
    x = (x * r * w).to(x_ptr.dtype.element_ty).to(tl.float32)
    x_partner = (x_partner * r * w_partner).to(x_ptr.dtype.element_ty).to(tl.float32)
    return _rope(x, x_partner, cos_ptr, sin_ptr, offs, is_rot, first)


@triton.jit
def _rotate_head(x_ptr, out_ptr, cos_ptr, sin_ptr, head_dim, ROTARY_DIM: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    y = _rotated(x_ptr, cos_ptr, sin_ptr, head_dim, ROTARY_DIM, BLOCK)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=offs < head_dim)


@triton.jit
def _program_rows(cos_ptr, sin_ptr, stride_cos, stride_sin):
    """Program (token, head) of a launch over [T, Hq + Hk] and its token's cos / sin rows."""
    token = tl.program_id(0).to(tl.int64)
    return token, tl.program_id(1), cos_ptr + token * stride_cos, sin_ptr + token * stride_sin


@fast_kernel
@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
                   stride_qot, stride_qoh, stride_kot, stride_koh, num_q_heads, head_dim,
                   ROTARY_DIM: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    token, head, cos_row, sin_row = _program_rows(cos_ptr, sin_ptr, stride_cos, stride_sin)
    if head < num_q_heads:
        _rotate_head(q_ptr + token * stride_qt + head * stride_qh,
                     q_out_ptr + token * stride_qot + head * stride_qoh,
                     cos_row, sin_row, head_dim, ROTARY_DIM, BLOCK)
    else:
        kv_head = head - num_q_heads
        _rotate_head(k_ptr + token * stride_kt + kv_head * stride_kh,
                     k_out_ptr + token * stride_kot + kv_head * stride_koh,
                     cos_row, sin_row, head_dim, ROTARY_DIM, BLOCK)


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary on the first `rotary_dim = cos.size(-1)` features of q [T, Hq, D] and k [T, Hk, D]."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    rotary_dim = cos.size(-1)
    assert k.shape == (num_tokens, num_k_heads, head_dim), f'k {tuple(k.shape)} does not match q {tuple(q.shape)}'
    assert cos.shape == sin.shape == (num_tokens, rotary_dim), 'cos/sin must be [T, rotary_dim]'
    assert rotary_dim % 2 == 0 and rotary_dim <= head_dim, f'bad rotary_dim {rotary_dim} for head_dim {head_dim}'
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    q, k, cos, sin = (_unit_last_stride(x) for x in (q, k, cos, sin))
    _rotary_kernel[(num_tokens, num_q_heads + num_k_heads)](
        q, k, cos, sin, q_out, k_out,
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kt=k.stride(0), stride_kh=k.stride(1),
        stride_cos=cos.stride(0), stride_sin=sin.stride(0),
        stride_qot=q_out.stride(0), stride_qoh=q_out.stride(1), stride_kot=k_out.stride(0),
        stride_koh=k_out.stride(1), num_q_heads=num_q_heads, head_dim=head_dim,
        ROTARY_DIM=rotary_dim, BLOCK=triton.next_power_of_2(head_dim),
        num_warps=1 if head_dim <= 256 else 4,
    )
    return q_out, k_out


@fast_kernel
@triton.jit
def _rotary_fill_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                        qw_ptr, kw_ptr, eps, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                        stride_cos, stride_sin, stride_qot, stride_qoh, stride_cp, stride_co, stride_ch, page_size,
                        num_q_heads, head_dim, HAS_NORM: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                        ROTARY_DIM: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    token, head, cos_row, sin_row = _program_rows(cos_ptr, sin_ptr, stride_cos, stride_sin)
    if head < num_q_heads:
        q_row = q_ptr + token * stride_qt + head * stride_qh
        if HAS_NORM:
            offs = tl.arange(0, BLOCK)
            q = _normed_rotated(q_row, qw_ptr, cos_row, sin_row, head_dim, eps, ZERO_CENTERED, ROTARY_DIM, BLOCK)
            tl.store(q_out_ptr + token * stride_qot + head * stride_qoh + offs,
                     q.to(q_out_ptr.dtype.element_ty), mask=offs < head_dim)
        else:
            _rotate_head(q_row, q_out_ptr + token * stride_qot + head * stride_qoh, cos_row, sin_row, head_dim,
                         ROTARY_DIM, BLOCK)
    else:
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:
            kv_head = head - num_q_heads
            offs = tl.arange(0, BLOCK)
            mask = offs < head_dim
            dst = (slot // page_size) * stride_cp + (slot % page_size) * stride_co + kv_head * stride_ch + offs
            k_row = k_ptr + token * stride_kt + kv_head * stride_kh
            if HAS_NORM:
                k = _normed_rotated(k_row, kw_ptr, cos_row, sin_row, head_dim, eps, ZERO_CENTERED, ROTARY_DIM,
                                    BLOCK)
            else:
                k = _rotated(k_row, cos_row, sin_row, head_dim, ROTARY_DIM, BLOCK)
            k = k.to(k_ptr.dtype.element_ty)
            tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
            v = tl.load(v_ptr + token * stride_vt + kv_head * stride_vh + offs, mask=mask)
            tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def rotary_fill_kv_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                         qk_norm=None) -> torch.Tensor:
    """`apply_rotary` on q [T, Hq, D] and k [T, Hk, D], then `fill_kv_cache` of the rotated k and of v [T, Hk, D]
    into `k_cache` / `v_cache` ([P, kbs, Hk, D] views of one layout) at `slot_mapping` [T], in one launch.
    `qk_norm` (`nn.attention.QKNorm`: q and k weights [D], eps, zero_centered) RMS-normalises each q and k head
    first, as the separate `rms_norm` calls would. Returns the rotated q (a new contiguous tensor)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    rotary_dim = cos.size(-1)
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim), \
        f'k {tuple(k.shape)} / v {tuple(v.shape)} do not match q {tuple(q.shape)}'
    assert cos.shape == sin.shape == (num_tokens, rotary_dim), 'cos/sin must be [T, rotary_dim]'
    assert rotary_dim % 2 == 0 and rotary_dim <= head_dim, f'bad rotary_dim {rotary_dim} for head_dim {head_dim}'
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride(), \
        'k_cache and v_cache must be [P, kbs, H, D] views of one layout'
    assert tuple(k_cache.shape[2:]) == (num_kv_heads, head_dim) and k_cache.stride(3) == 1, \
        f'cache heads/dim {tuple(k_cache.shape[2:])} != {(num_kv_heads, head_dim)} (or head_dim not contiguous)'
    assert slot_mapping.shape == (num_tokens,) and not slot_mapping.is_floating_point()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    q, k, v, cos, sin, slot_mapping = (_unit_last_stride(x) for x in (q, k, v, cos, sin, slot_mapping))
    if qk_norm is not None:
        q_w, k_w, eps, zero_centered = qk_norm
        assert q_w.shape == k_w.shape == (head_dim,), 'q/k norm weights must be [head_dim]'
        q_w, k_w = q_w.contiguous(), k_w.contiguous()
    else:
        q_w = k_w = cos  # never read
        eps, zero_centered = 0.0, False
    _rotary_fill_kernel[(num_tokens, num_q_heads + num_kv_heads)](
        q, k, v, cos, sin, q_out, k_cache, v_cache, slot_mapping, q_w, k_w, float(eps),
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kt=k.stride(0), stride_kh=k.stride(1),
        stride_vt=v.stride(0), stride_vh=v.stride(1), stride_cos=cos.stride(0), stride_sin=sin.stride(0),
        stride_qot=q_out.stride(0), stride_qoh=q_out.stride(1), stride_cp=k_cache.stride(0),
        stride_co=k_cache.stride(1), stride_ch=k_cache.stride(2), page_size=k_cache.size(1),
        num_q_heads=num_q_heads, head_dim=head_dim, HAS_NORM=qk_norm is not None, ZERO_CENTERED=bool(zero_centered),
        ROTARY_DIM=rotary_dim, BLOCK=triton.next_power_of_2(head_dim), num_warps=1 if head_dim <= 256 else 4,
    )
    return q_out
