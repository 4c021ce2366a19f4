"""Triton causal depthwise conv1d with a per-sequence input history; semantics of `kernels/default/causal_conv1d.py`.

Notation: sequence b owns tokens ``bos..eos`` (``L = eos - bos``), its history ``hist_b`` is ``[C, K-1]`` (zeros
when fresh, else ``conv_state[state_ids[b]]``, oldest first) and ``xx_b = [hist_b, x_b]``. Token ``bos + t``
reads ``xx_b[t .. t + K-1]``, i.e. packed position ``p = bos + t - (K-1) + j`` for tap j: ``x[p]`` when
``p >= bos``, else history column ``K-1 + p - bos``. A fresh sequence never reads its slot.

Two launch plans, chosen from host-side shapes only (no device sync):

* decode (``T == B``, which covers every pure decode step): one program per (sequence, channel block) computes
  the outputs of its few tokens and then writes the new state. Correct for any lengths, but serial over a
  sequence's tokens, so only used when the average length is 1.
* general: ``_conv_tokens_kernel`` over (token block, channel block) computes every output from the untouched
  pool, then the per-sequence kernel (outputs off) writes the states. Stream order puts every read of an old
  history before any write of a new one. With ``SPLIT_HISTORY`` (the default; ``LMDEPLOY_CONV_SPLIT_HISTORY=0``
  turns it off) the token-parallel kernel reads no history at all (its address and mask arithmetic, 64 predicated
  scalar loads a thread in the sm90 PTX, for the few outputs that need one): it computes the first K-1 outputs of
  a sequence that has a history as if fresh, and the per-sequence kernel, launched after it, recomputes and
  overwrites exactly those outputs from the old history before writing the new one. That halved the kernel's
  time for a 1K prompt (H100 run 75, `docs/benchmarks.md`: 43.8 -> 21.6 us for 8,192 channels, 1.9x its floor).

The state update writes the last K-1 columns of ``xx_b`` (so a segment shorter than K-1 keeps the newer part of
its old history, and a zero-length one keeps it, or zeroes it if fresh). Slots are distinct, so a slot is only
touched by the programs of its own sequence, which load everything they need before a block barrier and store
after it.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .launch import fast_kernel, wait_for_inputs


@triton.jit
def _plane_of(chans, channels, bound1, bound2, bound3):
    """(first channel, width) of the output plane each channel lands in: planes ``[0, b1)``, ``[b1, b2)``,
    ``[b2, b3)``, ``[b3, C)`` (unused bounds equal ``C``), each stored as a contiguous ``[T, width]`` block at
    element ``T * first`` of the flat output (one plane of width C is the plain ``[T, C]`` layout)."""
    lo = tl.where(chans >= bound1, bound1, 0)
    lo = tl.where(chans >= bound2, bound2, lo)
    lo = tl.where(chans >= bound3, bound3, lo)
    hi = tl.where(chans < bound3, bound3, channels)
    hi = tl.where(chans < bound2, bound2, hi)
    hi = tl.where(chans < bound1, bound1, hi)
    return lo.to(tl.int64), (hi - lo).to(tl.int64)


@fast_kernel
@triton.jit
def _conv_tokens_kernel(x_ptr, w_ptr, bias_ptr, state_ptr, out_ptr, seq_of_token_ptr, cu_seqlens_ptr, state_ids_ptr,
                        fresh_ptr, num_tokens, channels, stride_xt, stride_wc, stride_wk, stride_s0, stride_s1,
                        stride_s2, bound1, bound2, bound3, KERNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
                        SILU: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, ALIGNED: tl.constexpr,
                        READ_HISTORY: tl.constexpr = True, PDL: tl.constexpr = False):
    """Program (token block, channel block). ALIGNED (the channel count and every plane bound a multiple of 8):
    a channel block inside one plane stores through that plane's row stride, its offsets and mask marked as
    16-byte aligned runs of 8, so the compiler emits vector stores; the per-column plane layout stores element by
    element (`tests/kernels/test_kernel_ptx.py` reads both forms in the sm90 PTX), the suspected cause of the
    kernel's 3.8x its copy floor on an H100."""
    wait_for_inputs(PDL)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_mask = tokens < num_tokens
    c_mask = chans < channels
    seq = tl.load(seq_of_token_ptr + tokens, mask=t_mask, other=0)
    bos = tl.load(cu_seqlens_ptr + seq, mask=t_mask, other=0).to(tl.int64)
    if READ_HISTORY:
        slot = tl.load(state_ids_ptr + seq, mask=t_mask, other=0).to(tl.int64)
        has_hist = tl.load(fresh_ptr + seq, mask=t_mask, other=1) == 0
    tokens64 = tokens.to(tl.int64)

    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + chans, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(KERNEL):
        pos = tokens64 - (KERNEL - 1) + j
        from_x = pos >= bos
        x_mask = (t_mask & from_x)[:, None] & c_mask[None, :]
        val = tl.load(x_ptr + pos[:, None] * stride_xt + chans[None, :], mask=x_mask, other=0.0).to(tl.float32)
        if READ_HISTORY:
            col = KERNEL - 1 + pos - bos
            h_mask = (t_mask & (pos < bos) & has_hist)[:, None] & c_mask[None, :]
            h_ptrs = state_ptr + slot[:, None] * stride_s0 + chans[None, :] * stride_s1 + col[:, None] * stride_s2
            val += tl.load(h_ptrs, mask=h_mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + chans * stride_wc + j * stride_wk, mask=c_mask, other=0.0).to(tl.float32)
        acc += val * w[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    out = acc.to(out_ptr.dtype.element_ty)
    first = tl.program_id(1) * BLOCK_C
    lo_first, width_first = _plane_of(first, channels, bound1, bound2, bound3)
    lo_last, _ = _plane_of(tl.minimum(first + BLOCK_C, channels) - 1, channels, bound1, bound2, bound3)
    if ALIGNED and lo_first == lo_last:   # one plane: [T, width] rows at element T * lo
        rows = tl.multiple_of(tokens64 * width_first, 8)
        cols = tl.max_contiguous(tl.multiple_of(num_tokens * lo_first + first - lo_first + tl.arange(0, BLOCK_C), 8),
                                 BLOCK_C)
        runs = tl.max_constancy(c_mask, 8)   # channels a multiple of 8: the mask is constant over runs of 8
        tl.store(out_ptr + rows[:, None] + cols[None, :], out, mask=t_mask[:, None] & runs[None, :])
    else:
        lo, width = _plane_of(chans, channels, bound1, bound2, bound3)
        out_offs = num_tokens * lo[None, :] + tokens64[:, None] * width[None, :] + (chans - lo)[None, :]
        tl.store(out_ptr + out_offs, out, mask=t_mask[:, None] & c_mask[None, :])


@fast_kernel
@triton.jit
def _conv_sequence_kernel(x_ptr, w_ptr, bias_ptr, state_ptr, out_ptr, cu_seqlens_ptr, state_ids_ptr, fresh_ptr,
                          num_tokens, channels, stride_xt, stride_wc, stride_wk, stride_s0, stride_s1, stride_s2,
                          bound1, bound2, bound3,
                          KERNEL: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                          WRITE_OUTPUT: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr,
                          HEAD_OUTPUT: tl.constexpr = False, PDL: tl.constexpr = False):
    """Program (sequence, channel block): with WRITE_OUTPUT every output of the sequence, with HEAD_OUTPUT (the
    token-parallel kernel ran without the history) its first K-1 outputs if it has a history; then its new
    history."""
    wait_for_inputs(PDL)
    seq = tl.program_id(0)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = chans < channels
    bos = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    seqlen = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64) - bos
    slot = tl.load(state_ids_ptr + seq).to(tl.int64)
    has_hist = tl.load(fresh_ptr + seq) == 0
    hist_ptr = state_ptr + slot * stride_s0 + chans * stride_s1

    if WRITE_OUTPUT or HEAD_OUTPUT:
        lo, width = _plane_of(chans, channels, bound1, bound2, bound3)
        out_base = out_ptr + num_tokens * lo + (chans - lo)
        bias = tl.zeros([BLOCK_C], dtype=tl.float32)
        if HAS_BIAS:
            bias += tl.load(bias_ptr + chans, mask=c_mask, other=0.0).to(tl.float32)
        num_out = seqlen
        if not WRITE_OUTPUT:
            num_out = tl.where(has_hist, tl.minimum(seqlen, KERNEL - 1), 0)
        for t in range(0, num_out):
            acc = bias
            for j in tl.static_range(KERNEL):
                pos = bos + t - (KERNEL - 1) + j  # a token of b if pos >= bos, else history column K-1+pos-bos
                # scalar conditions enter masks through tl.where (the interpreter mis-types scalar & vector)
                val = tl.load(x_ptr + pos * stride_xt + chans, mask=tl.where(pos >= bos, c_mask, False), other=0.0)
                hist = tl.load(hist_ptr + (KERNEL - 1 + pos - bos) * stride_s2,
                               mask=tl.where((pos < bos) & has_hist, c_mask, False), other=0.0)
                w = tl.load(w_ptr + chans * stride_wc + j * stride_wk, mask=c_mask, other=0.0).to(tl.float32)
                acc += (val.to(tl.float32) + hist.to(tl.float32)) * w
            if SILU:
                acc = acc * tl.sigmoid(acc)
            tl.store(out_base + (bos + t) * width, acc.to(out_ptr.dtype.element_ty), mask=c_mask)

    # new column i is xx_b[L + i]: x[bos + L + i - (K-1)] if that is a token of b, else old column L + i
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < KERNEL - 1
    rel = seqlen + cols - (KERNEL - 1)
    x_mask = c_mask[:, None] & (col_mask & (rel >= 0))[None, :]
    new = tl.load(x_ptr + (bos + rel)[None, :] * stride_xt + chans[:, None], mask=x_mask, other=0.0)
    h_mask = tl.where(has_hist, c_mask[:, None] & (col_mask & (rel < 0))[None, :], False)
    old = tl.load(hist_ptr[:, None] + (seqlen + cols)[None, :] * stride_s2, mask=h_mask, other=0.0)
    new = tl.where((rel >= 0)[None, :], new.to(tl.float32), old.to(tl.float32))  # a bit-exact copy
    tl.debug_barrier()  # every read of the old history above happens before any store below
    tl.store(hist_ptr[:, None] + cols[None, :] * stride_s2, new.to(state_ptr.dtype.element_ty),
             mask=c_mask[:, None] & col_mask[None, :])


def fresh_flags(is_fresh: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`is_fresh` as the kernels read it (one byte a sequence, nonzero = fresh): a uint8 view of a contiguous bool
    tensor already on `device`, so no launch (one per layer inside a decode graph otherwise); else a copy."""
    if is_fresh.dtype == torch.bool and is_fresh.device == device and is_fresh.is_contiguous():
        return is_fresh.view(torch.uint8)
    return is_fresh.to(device=device, dtype=torch.uint8).contiguous()


def seq_of_token_of(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[T]: the sequence each packed token belongs to."""
    return torch.searchsorted(cu_seqlens[1:].contiguous(),
                              torch.arange(num_tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype), right=True)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_ids: torch.Tensor,
    is_fresh: torch.Tensor,
    cu_seqlens: torch.Tensor,
    activation: str | None = 'silu',
    fresh_u8: torch.Tensor | None = None,
    seq_of_token: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal depthwise conv over packed varlen sequences, continuing from a stored input history.

    Same contract as `kernels.default.causal_conv1d.causal_conv1d`: x ``[T, C]``; weight ``[C, K]``; bias ``[C]``
    or None; conv_state pool ``[num_slots, C, K-1]`` (any strides); state_ids int64 ``[B]`` (distinct); is_fresh
    bool ``[B]``; cu_seqlens int64 ``[B+1]`` with ``cu_seqlens[-1] == T``. Returns ``[T, C]`` in ``x.dtype`` and
    updates ``conv_state`` rows in place. ``fresh_u8`` (`fresh_flags(is_fresh, x.device)`) and ``seq_of_token``
    (`seq_of_token_of(cu_seqlens, T)`) may be given, built once per forward for every layer.
    """
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(x, weight, bias, conv_state, state_ids, is_fresh, cu_seqlens, activation, fresh_u8, seq_of_token, out,
            ())
    return out


_MAX_PLANES = 4
# The token-parallel kernel without the history, the per-sequence one writing the outputs that need it (module
# docstring); LMDEPLOY_CONV_SPLIT_HISTORY=0 (read at import) keeps the history in the token-parallel kernel.
SPLIT_HISTORY = os.environ.get('LMDEPLOY_CONV_SPLIT_HISTORY', '1') != '0'
# The token-parallel kernel's vector stores (`_conv_tokens_kernel`'s ALIGNED); LMDEPLOY_CONV_VECTOR_STORES=0 (read at
# import) stores through the per-column plane layout everywhere. With the history split off, both forms measured
# the same (H100 run 75); the engine's cold 1K row was measured with these defaults together.
VECTOR_STORES = os.environ.get('LMDEPLOY_CONV_VECTOR_STORES', '1') != '0'


def _tiles_from_env(name: str) -> tuple[int, int, int] | None:
    """`LMDEPLOY_CONV_TILES=BLOCK_T,BLOCK_C,num_warps` (powers of two), for measuring tiles inside the engine."""
    text = os.environ.get(name, '').strip()
    if not text:
        return None
    try:
        tiles = tuple(int(v) for v in text.split(','))
    except ValueError:
        tiles = ()
    if len(tiles) != 3 or any(v <= 0 or v & (v - 1) for v in tiles):
        raise ValueError(f'{name}={text!r}: expected three powers of two, BLOCK_T,BLOCK_C,num_warps')
    return tiles


# (BLOCK_T, BLOCK_C, num_warps) of `_conv_tokens_kernel` when set (`benchmark/bench_conv1d.py` sweeps it; read at
# import from LMDEPLOY_CONV_TILES)
TOKEN_TILES: tuple[int, int, int] | None = _tiles_from_env('LMDEPLOY_CONV_TILES')


# Prompts of at least this many tokens take 128-channel tiles (`token_tiles`).
WIDE_TILE_TOKENS = 512


def token_tiles(channels: int, num_tokens: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_C, num_warps) of the token-parallel kernel: `TOKEN_TILES` if set, else 8 tokens on 2 warps,
    by up to 128 channels from `WIDE_TILE_TOKENS` tokens up and up to 64 below. The history split off (the default
    since H100 run 75), 8 x 128 was the best of the swept tiles for every prompt timed, 1K / 8K / 32K tokens: 19.7 /
    115.2 / 435.7 us against 21.6 / 164.7 / 637.9 at 8 x 64 (runs 75-76), and 512 tokens ran at the best of the
    sweep with it (run 78); a 100-token suffix liked 8 x 64 best (8.6 us, run 75). Both binaries compile at start-up
    (`engine/warm_start.py` runs prompts on both sides of the threshold)."""
    if TOKEN_TILES is not None:
        return TOKEN_TILES
    width = 128 if num_tokens >= WIDE_TILE_TOKENS else 64
    return 8, min(triton.next_power_of_2(channels), width), 2


def causal_conv1d_planes(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_ids: torch.Tensor,
    is_fresh: torch.Tensor,
    cu_seqlens: torch.Tensor,
    out_splits: tuple[int, ...],
    activation: str | None = 'silu',
    fresh_u8: torch.Tensor | None = None,
    seq_of_token: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """`causal_conv1d(...).split(out_splits, -1)` with each channel group a contiguous ``[T, C_i]`` tensor, from
    one launch plan over all channels: the kernels store channel c of token t at ``T * s_i + t * C_i + (c - s_i)``
    of one flat buffer, where group i spans channels ``[s_i, s_i + C_i)``, and each group is a view of its block.
    The values are the plain call's, bit for bit (only the store address differs). fla's kernels `.contiguous()`
    their inputs, so a channel slice of one ``[T, C]`` output would be copied there. At most four groups. The
    backend's default; off with `LMDEPLOY_FUSED_PREFILL=0`."""
    splits = tuple(int(w) for w in out_splits)
    if sum(splits) != x.shape[1] or any(w < 0 for w in splits):
        raise ValueError(f'out_splits {splits} must be non-negative and sum to {x.shape[1]} channels')
    if not 1 <= len(splits) <= _MAX_PLANES:
        raise ValueError(f'causal_conv1d_planes takes 1 to {_MAX_PLANES} groups, got {len(splits)}')
    num_tokens = x.shape[0]
    flat = torch.empty(num_tokens * x.shape[1], dtype=x.dtype, device=x.device)
    starts = [sum(splits[:i]) for i in range(len(splits))]
    _launch(x, weight, bias, conv_state, state_ids, is_fresh, cu_seqlens, activation, fresh_u8, seq_of_token, flat,
            tuple(starts[1:]))
    return tuple(flat[num_tokens * s:num_tokens * (s + w)].view(num_tokens, w) for s, w in zip(starts, splits))


def _launch(x, weight, bias, conv_state, state_ids, is_fresh, cu_seqlens, activation, fresh_u8, seq_of_token, out,
            bounds: tuple[int, ...]) -> None:
    """Runs the conv into ``out``: channels split into planes at ``bounds`` (ascending, at most three; see
    `_plane_of`), ``out`` contiguous with ``T * C`` elements."""
    if activation not in (None, 'silu'):
        raise ValueError(f'unsupported activation: {activation}')
    num_tokens, channels = x.shape
    kernel = weight.shape[-1]
    num_seqs = state_ids.shape[0]
    assert weight.shape == (channels, kernel) and kernel >= 2, f'bad weight shape {tuple(weight.shape)}'
    assert conv_state.shape[1:] == (channels, kernel - 1), f'bad conv_state shape {tuple(conv_state.shape)}'
    assert cu_seqlens.shape == (num_seqs + 1,) and is_fresh.shape == (num_seqs,)
    assert out.is_contiguous() and out.numel() == num_tokens * channels and len(bounds) < _MAX_PLANES
    if num_seqs == 0:
        return
    if x.stride(-1) != 1:
        x = x.contiguous()
    bound1, bound2, bound3 = tuple(bounds) + (channels,) * (_MAX_PLANES - 1 - len(bounds))
    fresh = fresh_flags(is_fresh, x.device) if fresh_u8 is None else fresh_u8
    common = dict(num_tokens=num_tokens, channels=channels, stride_xt=x.stride(0), stride_wc=weight.stride(0),
                  stride_wk=weight.stride(1), stride_s0=conv_state.stride(0), stride_s1=conv_state.stride(1),
                  stride_s2=conv_state.stride(2), bound1=bound1, bound2=bound2, bound3=bound3, KERNEL=kernel,
                  HAS_BIAS=bias is not None, SILU=activation == 'silu')
    bias_arg = bias if bias is not None else weight
    is_decode = num_tokens == num_seqs
    if not is_decode and num_tokens > 0:
        block_t, block_c, warps = token_tiles(channels, num_tokens)
        if seq_of_token is None:
            seq_of_token = seq_of_token_of(cu_seqlens, num_tokens)
        grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(channels, block_c))
        aligned = VECTOR_STORES and all(b % 8 == 0 for b in (channels, *bounds)) and out.data_ptr() % 16 == 0
        _conv_tokens_kernel[grid](x, weight, bias_arg, conv_state, out, seq_of_token, cu_seqlens, state_ids, fresh,
                                  BLOCK_T=block_t, BLOCK_C=block_c, ALIGNED=aligned, READ_HISTORY=not SPLIT_HISTORY,
                                  num_warps=warps, **common)
    block_c = min(triton.next_power_of_2(channels), 256)
    block_h = max(triton.next_power_of_2(kernel - 1), 2)
    _conv_sequence_kernel[(num_seqs, triton.cdiv(channels, block_c))](
        x, weight, bias_arg, conv_state, out, cu_seqlens, state_ids, fresh, WRITE_OUTPUT=is_decode,
        HEAD_OUTPUT=SPLIT_HISTORY and not is_decode, BLOCK_C=block_c, BLOCK_H=block_h, num_warps=4, **common)
