"""Token-by-token gated delta rule that updates the engine's state pool in place (decode and verify forwards).

Contract of `kernels/default/gated_delta_rule.recurrent_gated_delta_rule` (layout, fresh rows, grouped value
heads, l2norm, float32 math, pool dtype on return), plus optional **cuts**: `cut_slots` int64 ``[B, C]``, and
after the (j + 1)-th token of sequence b (j < C) the state is also written to pool row ``cut_slots[b, j]``. A
verify forward of K drafts (`nn/draft_cuts.py`) passes its `draft_state_slots` (C = K) and gets in one launch what
K + 1 decode calls with a row copy after each compute; with cuts the state is rounded to the pool dtype after
every token, as those decode calls store and reload it, so the two are equal bit for bit on any pool dtype.

Why a kernel of our own: fla's `fused_recurrent_gated_delta_rule` takes a contiguous batch of initial states and
returns the final ones, so the engine gathered pool rows into a float32 copy, masked fresh rows and scattered the
result back, three passes over every state beside fla's own read and write. On a Qwen3.5-9B shape at batch 128
those passes cost 15 of a 27 ms decode step (H200 run 7, `benchmark/profile_decode.py`). Here each program
loads its tile of one sequence's state straight from its pool row (zeros if fresh, so stale NaN never reaches
the result), runs every token of the sequence on it in registers, and stores it back: the state crosses memory
once each way, which is the floor of this op.

One program per (sequence, value head, block of BLOCK_V value columns): it holds the state tile ``[Dk, BLOCK_V]``
in float32; per token it loads q and k of the head's key head (``h // (H // Hk)``), l2-normalises them
(``x * rsqrt(sum(x^2) + 1e-6)``), scales q by ``Dk ** -0.5``, then ``S = exp(g) S; S += k (beta (v - k^T S))^T;
o = S^T q`` for its columns. Programs share no state (state_ids are distinct), so the in-place update is safe.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .causal_conv1d import fresh_flags
from .gated_delta_gating import SOFTPLUS_THRESHOLD, gating_values
from .gated_delta_rule import check_shapes
from .launch import arrival_counters, fast_kernel, wait_for_inputs

_L2NORM_EPS = 1e-6


@fast_kernel
@triton.jit
def _fused_recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, cu_ptr, ids_ptr, fresh_ptr,
                            cut_ptr, a_log_ptr, dt_bias_ptr, z_ptr, norm_w_ptr, count_ptr, stride_qt, stride_qh,
                            stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt, stride_ot, stride_oh,
                            stride_s0, stride_sh, stride_sk, stride_cut, stride_zt, stride_zh, scale, norm_eps,
                            EPS: tl.constexpr, GROUP: tl.constexpr, DIM_K: tl.constexpr, DIM_V: tl.constexpr,
                            BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, L2NORM: tl.constexpr,
                            NUM_CUTS: tl.constexpr, ROUND: tl.constexpr, GATING: tl.constexpr,
                            THRESHOLD: tl.constexpr, OUT_NORM: tl.constexpr, BLOCK_DV: tl.constexpr,
                            PDL: tl.constexpr = False):
    """With GATING, g_ptr / beta_ptr are the raw projections a / b; with OUT_NORM the outputs are gated-normed
    in place by the last program of their (sequence, head) (see `fused_recurrent_gated_delta_rule`)."""
    wait_for_inputs(PDL)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    k_head = head // GROUP
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    rows = tl.arange(0, BLOCK_K)
    mask_k, mask_v = rows < DIM_K, cols < DIM_V
    mask = mask_k[:, None] & mask_v[None, :]
    bos = tl.load(cu_ptr + seq)
    eos = tl.load(cu_ptr + seq + 1)
    slot = tl.load(ids_ptr + seq)
    tile = rows[:, None] * stride_sk + cols[None, :]
    s_ptrs = state_ptr + slot * stride_s0 + head * stride_sh + tile
    s = tl.load(s_ptrs, mask=mask, other=0.0).to(tl.float32)
    s = tl.where(tl.load(fresh_ptr + seq) != 0, 0.0, s)   # where, not multiply: NaN in a fresh slot must not survive
    if GATING:
        a_log = tl.load(a_log_ptr + head).to(tl.float32)
        dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    for t in range(bos, eos):
        q = tl.load(q_ptr + t * stride_qt + k_head * stride_qh + rows, mask=mask_k, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * stride_kt + k_head * stride_kh + rows, mask=mask_k, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t * stride_vt + head * stride_vh + cols, mask=mask_v, other=0.0).to(tl.float32)
        if L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q, axis=0) + EPS)
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + EPS)
        q = q * scale
        if GATING:  # the gating kernel's values: g in float32, beta rounded to b's dtype as it stores it
            g, beta = gating_values(tl.load(g_ptr + t * stride_gt + head).to(tl.float32),
                                    tl.load(beta_ptr + t * stride_bt + head).to(tl.float32), a_log, dt_bias,
                                    THRESHOLD)
            beta = beta.to(beta_ptr.dtype.element_ty).to(tl.float32)
        else:
            g = tl.load(g_ptr + t * stride_gt + head).to(tl.float32)
            beta = tl.load(beta_ptr + t * stride_bt + head).to(tl.float32)
        s = s * tl.exp(g)
        delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(o_ptr + t * stride_ot + head * stride_oh + cols, o.to(o_ptr.dtype.element_ty), mask=mask_v)
        if ROUND:
            s = s.to(state_ptr.dtype.element_ty).to(tl.float32)
        if NUM_CUTS > 0:
            j = t - bos
            if j < NUM_CUTS:
                cut_slot = tl.load(cut_ptr + seq * stride_cut + j)
                tl.store(state_ptr + cut_slot * stride_s0 + head * stride_sh + tile,
                         s.to(state_ptr.dtype.element_ty), mask=mask)
    if OUT_NORM:  # before the state's store, so the arrival's release waits for the outputs' stores only
        gated_norm_head(o_ptr, z_ptr, norm_w_ptr, count_ptr + seq * tl.num_programs(1) + head, bos, eos, head,
                        stride_ot, stride_oh, stride_zt, stride_zh, norm_eps, DIM_V, BLOCK_DV)
    tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gated_norm_head(o_ptr, z_ptr, w_ptr, count_ptr, bos, eos, head, stride_ot, stride_oh, stride_zt, stride_zh, eps,
                    DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr):
    """The gated RMSNorm of one head's output rows (tokens bos..eos), in place, by the last of the head's programs
    (column blocks) to arrive at `count_ptr`, which it puts back to 0: every thread's output stores precede the
    barrier, the counter's acq_rel add orders them before that program's reads (which bypass L1). The rows it reads
    are in the output dtype, as the separate norm kernel reads them; the arithmetic is `rms_norm_rows`'
    (w * rmsnorm(o) * silu(z), float32)."""
    tl.debug_barrier()
    done = tl.atomic_add(count_ptr, 1, sem='acq_rel')
    if done == tl.num_programs(2) - 1:
        cols = tl.arange(0, BLOCK_DV)
        mask = cols < DIM_V
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        for t in range(bos, eos):
            o_ptrs = o_ptr + t * stride_ot + head * stride_oh + cols
            o = tl.load(o_ptrs, mask=mask, other=0.0, cache_modifier='.cg').to(tl.float32)
            z = tl.load(z_ptr + t * stride_zt + head * stride_zh + cols, mask=mask, other=0.0).to(tl.float32)
            y = o * tl.rsqrt(tl.sum(o * o, axis=0) / DIM_V + eps) * w
            y = y * z * tl.sigmoid(z)
            tl.store(o_ptrs, y.to(o_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(count_ptr, 0)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state: torch.Tensor,
    state_ids: torch.Tensor,
    is_fresh: torch.Tensor,
    use_qk_l2norm: bool = True,
    max_seqlen: int | None = None,
    cut_slots: torch.Tensor | None = None,
    gating_params: tuple[torch.Tensor, torch.Tensor] | None = None,
    out_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    block_v: int = 32,
    num_warps: int = 4,
) -> torch.Tensor:
    """``[T, H, Dv]`` outputs in ``v.dtype``; the pool rows of `state_ids` hold the final states (and the rows of
    `cut_slots` [B, C] the states after each of the first C tokens). `max_seqlen` is accepted for signature
    compatibility; nothing is read back to the host. See the module docstring.

    With `gating_params` = (A_log, dt_bias) [H], `g` and `beta` are the raw per-head projections a and b [T, H]
    and each program computes `gated_delta_gating(a, b, A_log, dt_bias)` for its head itself (the same code, so
    the same bits): the decode step's gating launch folded into this one.

    With `out_norm` = (z [T, H, Dv] with unit stride in Dv, weight [Dv], eps) the outputs come back as the gated
    DeltaNet's output norm of them, weight * rmsnorm(o) * silu(z) (`nn.norm.GatedRMSNorm`; o rounded to v's dtype
    first, as the separate norm reads it), computed by the last of each (sequence, head)'s programs to
    finish (`gated_norm_head`): the norm's launch folded into this one. `out_norm_supported` says when. The `cuda`
    backend passes it only with `LMDEPLOY_FOLD_OUT_NORM=1`: on the H100 (runs 47-48) the arrival's release and the
    serial tail cost a batch-32 decode of the 35B-A3B shape 1.8% and gained nothing at batch 1."""
    check_shapes(q, k, v, g, beta, cu_seqlens, state, state_ids, is_fresh)
    num_tokens, num_k_heads, dim_k = q.shape
    num_heads, dim_v = v.shape[1:]
    batch = state_ids.shape[0]
    assert state.stride(-1) == 1 and state.stride(-2) == dim_v, f'pool rows not contiguous: {state.stride()}'
    out = torch.empty(num_tokens, num_heads, dim_v, dtype=v.dtype, device=v.device)
    if batch == 0:
        return out
    num_cuts = 0 if cut_slots is None else cut_slots.shape[1]
    if cut_slots is None or num_cuts == 0:
        cut_slots, num_cuts = state_ids.view(-1, 1), 0
    assert cut_slots.shape[0] == batch
    q, k, v, g, beta, cut_slots = (_unit_last(x) for x in (q, k, v, g, beta, cut_slots))
    if gating_params is not None:
        a_log, dt_bias = (p.contiguous() for p in gating_params)
        assert a_log.shape == dt_bias.shape == (num_heads,), f'A_log / dt_bias {tuple(a_log.shape)} for {num_heads}'
    else:
        a_log = dt_bias = g  # unread
    fresh = fresh_flags(is_fresh, q.device)  # a view: no launch
    if out_norm is not None:
        z, norm_w, norm_eps = out_norm
        assert out_norm_supported(batch, num_heads) and z.shape == v.shape and z.stride(-1) == 1 \
            and norm_w.shape == (dim_v,), f'out_norm: z {tuple(z.shape)}, weight {tuple(norm_w.shape)}'
        norm_w, counters = norm_w.contiguous(), _norm_counters(q.device)
    else:
        z, norm_w, norm_eps, counters = v, v, 0.0, v   # unread
    block_v = min(block_v, triton.next_power_of_2(dim_v))
    grid = (batch, num_heads, triton.cdiv(dim_v, block_v))
    _fused_recurrent_kernel[grid](
        q, k, v, g, beta, out, state, cu_seqlens, state_ids, fresh, cut_slots, a_log, dt_bias, z, norm_w, counters,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        out.stride(0), out.stride(1), state.stride(0), state.stride(1), state.stride(2), cut_slots.stride(0),
        z.stride(0), z.stride(1), dim_k ** -0.5, float(norm_eps), EPS=_L2NORM_EPS, GROUP=num_heads // num_k_heads,
        DIM_K=dim_k, DIM_V=dim_v, BLOCK_K=triton.next_power_of_2(dim_k), BLOCK_V=block_v, L2NORM=use_qk_l2norm,
        NUM_CUTS=num_cuts, ROUND=num_cuts > 0 and state.dtype != torch.float32, GATING=gating_params is not None,
        THRESHOLD=SOFTPLUS_THRESHOLD, OUT_NORM=out_norm is not None, BLOCK_DV=triton.next_power_of_2(dim_v),
        num_warps=num_warps)
    return out


_MAX_NORM_COUNTERS = 1 << 16


def out_norm_supported(batch: int, num_heads: int) -> bool:
    """Whether a launch of `batch` sequences and `num_heads` value heads can take `out_norm`: one arrival counter
    per (sequence, head) in a fixed zeroed buffer (`_norm_counters`)."""
    return batch * num_heads <= _MAX_NORM_COUNTERS


def _norm_counters(device: torch.device) -> torch.Tensor:
    """The (sequence, head) arrival counters of `gated_norm_head` on `device` (`launch.arrival_counters`)."""
    return arrival_counters('gated_norm_head', _MAX_NORM_COUNTERS, device)
