"""Paged causal prefill attention over the packed KV pool, split over the keys for short queries on long contexts
(reference: `kernels/default/paged_attention.py`; the key-block step and the pool layout: `paged_attention.py`).

Queries are packed varlen rows `q` [T, Hq, D]; query `i` of sequence `b` sits at position `kv_len - q_len + i`.
A query tile is `BLOCK_M` rows of one sequence and one head. Keys before `full_end` (the tile's first position,
rounded down to `BLOCK_N`) are visible to every row of the tile and take the unmasked loop; only the stretch
`[full_end, causal_end)` up to the tile's last position is masked.

Two launch shapes, chosen on the host from static shapes only (`prefill_num_splits`):
- `S == 1`: program `(m, h, b)` runs the whole tile and writes the output. Long prompts have many tiles; this is
  the cold-prefill path. Program `m` takes tile `num_m - 1 - m`: the heaviest tiles of the causal triangle start
  first and the light ones fill the tail.
- `S > 1` (split-KV, flash-decoding style): a 100-token suffix after a 32K prefix has one or two tiles per head,
  i.e. a few dozen programs each scanning 32K keys in series, on a GPU with 132 SMs. Program `(m, h, b * S + s)`
  takes split `s` of the tile's unmasked keys: `split_len = max(min_split, cdiv(full_end, S))` rounded up to
  `BLOCK_N`, computed on the device, so `cdiv(full_end, split_len) <= S` splits are active and the rest exit at
  once; the last active split also runs the masked stretch. Each writes its normalised partial output and its
  log-sum-exp (base 2) in fp32; splits past the active ones write only a log-sum-exp of -inf for their rows. A
  merge kernel over the packed rows, program `(r, h, d)` for `MERGE_M` rows, one head and `MERGE_D` dims, reads
  every split's log-sum-exp and weighs the partials by it, `MERGE_S` splits a step (a -inf one weighs 0 and its
  partial is not read): it needs no sequence bookkeeping, and its grid follows the token count, not the batch
  (a mixed prefill graph of many sequence slots launches no idle programs). Invariant: every split starts at or
  before `full_end <= ` every row's position, so each row sees at least one key in every active split (finite
  lse, no NaN), exactly as in the unsplit loop; split 0 is active for every row.
- Packed query heads (the split launch of grouped heads, `Hq = GROUP * Hkv`, unless `LMDEPLOY_PACK_GQA=0`;
  `pack_gqa`): program `(m, kv_head, b * S + s)`, and the tile's rows are the `(token, query head)` pairs of that
  KV head's group, token-major (row `r` of tile `m`: token `(m * BLOCK_M + r) // GROUP`). Each key block a tile
  loads serves all the query heads its rows hold, and a short query pads one tile per KV head instead of one per
  query head (100 tokens, 8 query heads a KV head: 7 tiles of 128 rows a KV head, 1,792 rows for 1,600, against 16
  tiles, 2,048 rows, unpacked). The masking is the unpacked one on each row's own token; `full_end` comes from the
  tile's first token, `causal_end` from its last.
The grids depend on (T, Hq, B, S) only and the split lengths on device `q_lens` / `kv_lens`: CUDA-graph safe, and
eager and graph runs of the same shapes make the same split decision (identical numerics).
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .launch import device_sm_count, fast_kernel, wait_for_inputs
from .paged_attention import LOG2E, attend_block, check_cache, dot_precision

# Split rule (work per program): a split reads at least MIN_SPLIT_KEYS keys, so its fp32 partial (BLOCK_M x D x 4
# bytes, written once and read once by the merge) stays <= 1/8 of the K/V bytes it reads (2 x 512 x D x 2); and a
# shape whose fewest live programs (all T tokens in one sequence: cdiv(T, BLOCK_M) tiles per head) leave SMs idle
# is split into as many splits as keep them within one wave of one program per SM (the D 128 / 256 tiles hold one
# program per SM: ~190 KiB of shared memory). One full wave beat more splits on the H200 (bench_prefill_attention.py
# run 32, 100 tokens after 32,700, 16 tiles: 8 splits 192 us with the merge, 16 splits 206, 31 splits 233).
# Partials are capped at PARTIAL_BYTES.
MIN_SPLIT_KEYS = 512
MAX_SPLITS = 32
PARTIAL_BYTES = 64 << 20
# Grouped query heads packed into their KV head's tiles in split launches (`pack_gqa`): on by default since H100
# runs 58-63 (a 100-token suffix over 32,700 keys, D 256, 16 query heads on 2 KV heads: 0.42 -> 0.39 ms, the same
# error; its gpu tests and the engine tests pass); LMDEPLOY_PACK_GQA=0 keeps a tile per query head.
_PACK_GQA = os.environ.get('LMDEPLOY_PACK_GQA', '1') != '0'
MERGE_M = 8   # merge tile: rows x splits a step x dims (fp32, 4096 values)
MERGE_S = 8
MERGE_D = 64


@fast_kernel
@triton.jit(do_not_specialize=['num_splits'])
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, o_ptr, lse_ptr, block_tables_ptr, cu_seqlens_q_ptr, q_lens_ptr,
                    kv_lens_ptr, stride_qt, stride_qh, stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
                    stride_cp, stride_co, stride_ch, stride_bt, qk_scale, head_dim, num_splits, min_split,
                    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr, SPLIT: tl.constexpr,
                    PACK: tl.constexpr = False, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    # The last tiles (most keys under the causal mask) first: the scheduler then fills the tail with short tiles.
    # PACK: axis 1 is the KV head and a tile's rows are (token, query head of its group) pairs, token-major.
    m_start = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    head = tl.program_id(1)
    if SPLIT:
        seq = (tl.program_id(2) // num_splits).to(tl.int64)
        split = tl.program_id(2) % num_splits
        o_ptr += split.to(tl.int64) * stride_os
        lse_ptr += split.to(tl.int64) * stride_ls
    else:
        seq = tl.program_id(2).to(tl.int64)
    q_len = tl.load(q_lens_ptr + seq).to(tl.int32)
    num_rows = q_len
    if PACK:
        num_rows = q_len * GROUP
    if m_start >= num_rows:
        return
    kv_len = tl.load(kv_lens_ptr + seq).to(tl.int32)
    history = kv_len - q_len
    q_start = tl.load(cu_seqlens_q_ptr + seq).to(tl.int64)
    # Each row's token (`rows`), and its query head: `heads` as a [BLOCK_M] vector when packed, else the scalar head.
    if PACK:
        packed = m_start + tl.arange(0, BLOCK_M)
        rows = packed // GROUP
        heads = head * GROUP + packed % GROUP
        q_head = heads[:, None] * stride_qh
        o_head = heads[:, None] * stride_oh
        row_mask = packed < num_rows
        first = m_start // GROUP
        end = (m_start + BLOCK_M - 1) // GROUP + 1
        cache_head = head * stride_ch
    else:
        rows = m_start + tl.arange(0, BLOCK_M)
        heads = head
        q_head = head * stride_qh
        o_head = head * stride_oh
        row_mask = rows < q_len
        first = m_start
        end = m_start + BLOCK_M
        cache_head = (head // GROUP) * stride_ch
    # Keys < history + first precede every row of the tile; the rest, up to the last row's position, is diagonal.
    full_end = (history + first) // BLOCK_N * BLOCK_N
    causal_end = history + tl.minimum(end, q_len)
    lo = 0
    hi = full_end
    diag_start = full_end
    if SPLIT:
        split_len = tl.maximum(min_split, tl.cdiv(tl.cdiv(full_end, num_splits), BLOCK_N) * BLOCK_N)
        num_active = tl.maximum(1, tl.cdiv(full_end, split_len))
        if split >= num_active:  # weighs nothing in the merge, which then never reads this split's partial
            tl.store(lse_ptr + (q_start + rows) * stride_lt + heads, tl.full([BLOCK_M], float('-inf'), tl.float32),
                     mask=row_mask)
            return
        lo = split * split_len
        hi = tl.minimum(lo + split_len, full_end)
        # Only the last active split runs the masked stretch.
        diag_start = tl.where(split < num_active - 1, causal_end, full_end)

    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    q_offs = (q_start + rows)[:, None] * stride_qt + q_head + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    pos = history + rows

    m_i = tl.full([BLOCK_M], float('-inf'), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table_ptr = block_tables_ptr + seq * stride_bt
    for start in range(lo, hi, BLOCK_N):
        acc, l_i, m_i = attend_block(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, table_ptr, start, causal_end, pos,
                                     cache_head, stride_cp, stride_co, dims, dim_mask, qk_scale,
                                     PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N, IS_CAUSAL_BLOCK=False, EVEN_D=EVEN_D,
                                     PRECISION=PRECISION)
    for start in range(diag_start, causal_end, BLOCK_N):
        acc, l_i, m_i = attend_block(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, table_ptr, start, causal_end, pos,
                                     cache_head, stride_cp, stride_co, dims, dim_mask, qk_scale,
                                     PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N, IS_CAUSAL_BLOCK=True, EVEN_D=EVEN_D,
                                     PRECISION=PRECISION)

    out = acc / l_i[:, None]
    io_mask = row_mask[:, None] & dim_mask[None, :]
    o_offs = (q_start + rows)[:, None] * stride_ot + o_head + dims[None, :]
    tl.store(o_ptr + o_offs, out.to(o_ptr.dtype.element_ty), mask=io_mask)
    if SPLIT:
        tl.store(lse_ptr + (q_start + rows) * stride_lt + heads, m_i + tl.log2(l_i), mask=row_mask)


@fast_kernel
@triton.jit(do_not_specialize=['num_splits', 'batch_size'])
def _merge_kernel(part_ptr, lse_ptr, o_ptr, cu_seqlens_q_ptr, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
                  stride_ot, stride_oh, head_dim, num_splits, batch_size,
                  MERGE_M: tl.constexpr, MERGE_S: tl.constexpr, MERGE_D: tl.constexpr, PDL: tl.constexpr = False):
    """Packed rows `[r, r + MERGE_M)` (any sequences; rows past the last sequence's are padding and left alone), one
    head, dims `[d, d + MERGE_D)`: out = sum_s 2^(lse_s - m) part_s / sum_s 2^(lse_s - m), m the rows' max lse."""
    wait_for_inputs(PDL)
    rows = tl.program_id(0) * MERGE_M + tl.arange(0, MERGE_M)
    head = tl.program_id(1)
    dims = tl.program_id(2) * MERGE_D + tl.arange(0, MERGE_D)
    row_mask = rows < tl.load(cu_seqlens_q_ptr + batch_size)
    dim_mask = dims < head_dim
    tokens = rows.to(tl.int64)
    splits = tl.arange(0, MERGE_S)
    m_i = tl.full([MERGE_M], float('-inf'), dtype=tl.float32)
    w_i = tl.zeros([MERGE_M], dtype=tl.float32)
    acc = tl.zeros([MERGE_M, MERGE_D], dtype=tl.float32)
    for s0 in range(0, num_splits, MERGE_S):
        split_mask = (s0 + splits) < num_splits
        lse_mask = row_mask[:, None] & split_mask[None, :]
        lse = tl.load(lse_ptr + (s0 + splits)[None, :].to(tl.int64) * stride_ls + tokens[:, None] * stride_lt + head,
                      mask=lse_mask, other=float('-inf'))
        # Split 0 is active for every real row: m_new is finite from the first step on; padding rows use 0.
        m_new = tl.where(row_mask, tl.maximum(m_i, tl.max(lse, 1)), 0.0)
        alpha = tl.exp2(m_i - m_new)
        weight = tl.exp2(lse - m_new[:, None])  # 0 where lse is -inf (inactive split, masked load)
        live = weight > 0
        part_offs = ((s0 + splits)[None, :, None].to(tl.int64) * stride_ps + tokens[:, None, None] * stride_pt
                     + head * stride_ph + dims[None, None, :])
        part = tl.load(part_ptr + part_offs, mask=live[:, :, None] & dim_mask[None, None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.sum(part * weight[:, :, None], 1)
        w_i = w_i * alpha + tl.sum(weight, 1)
        m_i = m_new
    out = acc / tl.where(row_mask, w_i, 1.0)[:, None]
    tl.store(o_ptr + tokens[:, None] * stride_ot + head * stride_oh + dims[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_mask[:, None] & dim_mask[None, :])


def prefill_attention_config(head_dim: int, dtype: torch.dtype) -> dict:
    """Tile sizes and launch options per padded head_dim. Half types: the best of `bench_prefill_attention.py`'s
    sweep on the H200 (2026-12-01, 97a5fb5; cold 8K / 32K prompts in 8K chunks, GQA 16:4): D 256 M128 N64 w8 s2
    (392 / 470 TFLOP/s against 161 / 165 for the old M64 N32, 237 / 305 for SDPA flash), D 128 M128 N128 w8 s3
    (293 / 403 against 153 / 180, SDPA flash 221 / 322)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    if dtype == torch.float32:
        # fp32 runs the FMA path (ieee dot) with twice the bytes per tile: keep tiles small, correctness first.
        block_m, block_n = (32, 32) if block_d > 128 else (64, 32)
        return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=4, num_stages=1)
    if block_d <= 64:  # not swept yet
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_D=block_d, num_warps=4, num_stages=3)
    if block_d <= 128:
        return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_D=block_d, num_warps=8, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=64, BLOCK_D=block_d, num_warps=8, num_stages=2)


def prefill_num_splits(num_tokens: int, num_heads: int, head_dim: int, block_m: int, num_sms: int) -> int:
    """Key splits per query tile for a forward of `num_tokens` packed query rows (static shapes only; see the
    constants above for the rule)."""
    tiles = triton.cdiv(num_tokens, block_m) * num_heads
    if 2 * tiles > num_sms:  # a second split would not fit the wave
        return 1
    by_memory = PARTIAL_BYTES // (num_tokens * num_heads * (head_dim + 1) * 4)
    return max(1, min(MAX_SPLITS, num_sms // tiles, by_memory))


def _split_buffer(num_splits: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """An fp32 [num_splits, *shape] buffer whose split stride is a multiple of 16: the kernels' integer arguments
    then depend on the token count only through classes the warm start covers (`num_splits` is not specialized),
    so no request compiles a split-KV binary of its own."""
    numel = math.prod(shape)
    flat = torch.empty(num_splits, triton.cdiv(numel, 16) * 16, dtype=torch.float32, device=device)
    return flat[:, :numel].view(num_splits, *shape)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, q_lens: torch.Tensor, kv_lens: torch.Tensor,
                            max_seqlen_q: int, scale: float, num_splits: int | None = None,
                            min_split_keys: int = MIN_SPLIT_KEYS, config: dict | None = None,
                            pack_gqa: bool | None = None) -> torch.Tensor:
    """Causal attention of packed queries `q` [T, Hq, D] over each sequence's paged K/V (new tokens included).

    Query i of sequence b sits at position `kv_lens[b] - q_lens[b] + i` and sees keys at positions <= its own.
    `max_seqlen_q` (host int) only sizes the grid; it must be >= every `q_lens[b]`. `num_splits` (default: the rule
    of `prefill_num_splits`), `min_split_keys`, `config` (`prefill_attention_config`'s keys) and `pack_gqa`
    (default: packed when split and grouped, unless `LMDEPLOY_PACK_GQA=0`; see the module docstring) are for tests and
    benchmarks. Returns [T, Hq, D] in q's dtype; no host synchronisation.
    """
    assert q.dim() == 3, f'q must be [T, Hq, D], got {tuple(q.shape)}'
    batch_size = q_lens.numel()
    check_cache(q, k_cache, v_cache, block_tables, batch_size)
    assert cu_seqlens_q.shape == (batch_size + 1,) and kv_lens.shape == (batch_size,)
    out = torch.empty_like(q)
    num_tokens, num_heads, head_dim = q.shape
    if batch_size == 0 or num_tokens == 0 or max_seqlen_q == 0:
        return out
    cfg = dict(config or prefill_attention_config(head_dim, q.dtype))
    block_m, block_n = cfg['BLOCK_M'], cfg['BLOCK_N']
    group = num_heads // k_cache.size(2)
    packable = group > 1 and _PACK_GQA if pack_gqa is None else pack_gqa
    if num_splits is None:  # tiles counted as the launch would lay them out
        rows, heads = (num_tokens * group, k_cache.size(2)) if packable else (num_tokens, num_heads)
        num_splits = prefill_num_splits(rows, heads, head_dim, block_m, device_sm_count(q.device))
    assert num_splits >= 1
    split = num_splits > 1
    pack = packable and split if pack_gqa is None else pack_gqa
    min_split = triton.cdiv(max(min_split_keys, 1), block_n) * block_n
    if split:
        part = _split_buffer(num_splits, q.shape, q.device)
        lse = _split_buffer(num_splits, (num_tokens, num_heads), q.device)
    else:
        part, lse = out.unsqueeze(0), out.new_empty((1, 1, 1), dtype=torch.float32)
    if pack:
        grid = (triton.cdiv(max_seqlen_q * group, block_m), k_cache.size(2), batch_size * num_splits)
    else:
        grid = (triton.cdiv(max_seqlen_q, block_m), num_heads, batch_size * num_splits)
    _prefill_kernel[grid](
        q_ptr=q, k_cache_ptr=k_cache, v_cache_ptr=v_cache, o_ptr=part, lse_ptr=lse, block_tables_ptr=block_tables,
        cu_seqlens_q_ptr=cu_seqlens_q, q_lens_ptr=q_lens, kv_lens_ptr=kv_lens,
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_os=part.stride(0), stride_ot=part.stride(1),
        stride_oh=part.stride(2), stride_ls=lse.stride(0), stride_lt=lse.stride(1),
        stride_cp=k_cache.stride(0), stride_co=k_cache.stride(1), stride_ch=k_cache.stride(2),
        stride_bt=block_tables.stride(0), qk_scale=scale * LOG2E, head_dim=head_dim, num_splits=num_splits,
        min_split=min_split, PAGE_SIZE=k_cache.size(1), GROUP=group, EVEN_D=cfg['BLOCK_D'] == head_dim,
        PRECISION=dot_precision(q.dtype), SPLIT=split, PACK=pack, **cfg)
    if split:
        merge_d = min(MERGE_D, cfg['BLOCK_D'])
        _merge_kernel[(triton.cdiv(num_tokens, MERGE_M), num_heads, triton.cdiv(head_dim, merge_d))](
            part_ptr=part, lse_ptr=lse, o_ptr=out, cu_seqlens_q_ptr=cu_seqlens_q, stride_ps=part.stride(0),
            stride_pt=part.stride(1), stride_ph=part.stride(2), stride_ls=lse.stride(0), stride_lt=lse.stride(1),
            stride_ot=out.stride(0), stride_oh=out.stride(1), head_dim=head_dim, num_splits=num_splits,
            batch_size=batch_size, MERGE_M=MERGE_M, MERGE_S=MERGE_S, MERGE_D=merge_d, num_warps=4)
    return out
