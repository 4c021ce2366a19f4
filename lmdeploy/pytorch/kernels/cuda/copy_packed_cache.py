"""Logical KV block copy over the packed pool in one launch, and the state-pool row copy on the same kernel
(reference: `kernels/default/cache_copy.py`).

A logical block `b` is pages `[b * ppb, (b + 1) * ppb)`, so in every leading row (layer) it is one contiguous run of
`ppb * page_bytes` bytes. The kernel views the pool as `[rows, num_blocks, block_words]` of the widest integer word
that divides the block size (and the pool's alignment), and copies chunk `c` of block `src[i]` onto block `dst[i]`
in row `r` from program `(i * num_chunks + c, r)`.

Contract (the host validates it when building plans; invariant 6): destinations are unique and disjoint from
sources, so programs never race and the copy order does not matter. No host synchronisation happens here unless
`debug=True`, which checks the contract on the device and syncs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import fast_kernel, wait_for_inputs

# Bytes one program moves: 64 KiB = 128 B per thread at 16 warps (the best of the H200 launch-shape sweep in
# benchmark/bench_copy_packed_cache.py: ~92% of a device-to-device copy at kernel block sizes 16 and 64).
_CHUNK_BYTES = 65536
_NUM_WARPS = 16
_MAX_GRID_Y = 65535
_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


@fast_kernel
@triton.jit
def _copy_blocks_kernel(cache_ptr, src_ptr, dst_ptr, stride_row, block_words, num_chunks, BLOCK: tl.constexpr,
                        PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    pid = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    pair = pid // num_chunks
    chunk = pid % num_chunks
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_words
    row_ptr = cache_ptr + row * stride_row
    words = tl.load(row_ptr + src * block_words + offs, mask=mask)
    tl.store(row_ptr + dst * block_words + offs, words, mask=mask)


def _word_dtype(block_bytes: int, data_ptr: int) -> tuple[int, torch.dtype]:
    for size, dtype in _WORDS:
        if block_bytes % size == 0 and data_ptr % size == 0:
            return size, dtype
    raise AssertionError('unreachable: a byte always divides')


def _check_plan(src: torch.Tensor, dst: torch.Tensor, num_blocks: int) -> None:
    """Device-syncing contract check, only under `debug=True`."""
    both = torch.cat([src, dst])
    assert int(both.min()) >= 0 and int(both.max()) < num_blocks, 'block offset out of range'
    assert dst.unique().numel() == dst.numel(), 'destination blocks must be unique'
    assert not torch.isin(dst, src).any(), 'destination blocks must be disjoint from source blocks'


def copy_packed_cache(packed_cache: torch.Tensor, src_block_offsets: torch.Tensor, dst_block_offsets: torch.Tensor,
                      pages_per_block: int, debug: bool = False, chunk_bytes: int = _CHUNK_BYTES,
                      num_warps: int = _NUM_WARPS) -> None:
    """Copy all `pages_per_block` pages of block src[i] onto block dst[i], in every leading row (layer).

    `packed_cache` is a contiguous uint8 `[..., num_pages, page_bytes]`; the offsets are 1-D integer tensors of
    physical logical-block indices on the cache's device. Empty offsets launch nothing.
    """
    assert packed_cache.dtype == torch.uint8 and packed_cache.dim() >= 2, 'packed_cache must be uint8 [..., P, B]'
    assert packed_cache.is_contiguous(), 'packed_cache must be contiguous'
    assert src_block_offsets.dim() == 1 and src_block_offsets.shape == dst_block_offsets.shape, \
        f'offsets must be 1-D of equal length, got {tuple(src_block_offsets.shape)} {tuple(dst_block_offsets.shape)}'
    assert not src_block_offsets.is_floating_point() and not dst_block_offsets.is_floating_point()
    num_pairs = src_block_offsets.numel()
    if num_pairs == 0:
        return
    *_, num_pages, page_bytes = packed_cache.shape
    assert pages_per_block >= 1 and num_pages % pages_per_block == 0, \
        f'num_pages {num_pages} is not a multiple of pages_per_block {pages_per_block}'
    num_rows = packed_cache.numel() // (num_pages * page_bytes)
    num_blocks = num_pages // pages_per_block
    block_bytes = pages_per_block * page_bytes
    assert num_rows <= _MAX_GRID_Y, f'{num_rows} leading rows exceed the grid limit'
    if debug:
        _check_plan(src_block_offsets, dst_block_offsets, num_blocks)

    word_bytes, word_dtype = _word_dtype(block_bytes, packed_cache.data_ptr())
    words = packed_cache.view(num_rows, num_blocks * block_bytes).view(word_dtype)
    block_words = block_bytes // word_bytes
    block = min(triton.next_power_of_2(block_words), chunk_bytes // word_bytes)
    num_chunks = triton.cdiv(block_words, block)
    grid = (num_pairs * num_chunks, num_rows)
    _copy_blocks_kernel[grid](
        cache_ptr=words, src_ptr=src_block_offsets.contiguous(), dst_ptr=dst_block_offsets.contiguous(),
        stride_row=words.stride(0), block_words=block_words, num_chunks=num_chunks, BLOCK=block, num_warps=num_warps)


def copy_state_slots(state_pool: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor,
                     debug: bool = False) -> None:
    """Copy whole state-pool rows `src_slots[i] -> dst_slots[i]` (a row holds every recurrent layer's state) in one
    launch: the contiguous uint8 pool `[num_slots, row_bytes]` is one leading row of `num_slots` one-page blocks.
    Same contract as `copy_packed_cache` (the plans' destinations are unique and disjoint from their sources).
    torch's indexed copy of the same rows (`pool[dst] = pool[src]`, the default backend's) moves uint8 elements one
    by one: ~0.43 ms for one 49 MiB row of a Qwen3.5-9B shape on the H200, about 1/20 of the copy rate."""
    copy_packed_cache(state_pool, src_slots, dst_slots, 1, debug=debug)
