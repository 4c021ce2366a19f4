"""Pure-torch logical block copy over a packed cache: the reference for the Triton `copy_packed_cache`."""
from __future__ import annotations

import torch


def copy_packed_cache(packed_cache: torch.Tensor, src_block_offsets: torch.Tensor, dst_block_offsets: torch.Tensor,
                      pages_per_block: int) -> None:
    """Copy all `pages_per_block` pages of block src[i] onto block dst[i], in every leading row (layer).

    `packed_cache` is `[..., num_pages, page_bytes]`; destinations must be unique and disjoint from sources.
    """
    if src_block_offsets.numel() == 0:
        return
    *lead, num_pages, page_bytes = packed_cache.shape
    blocks = packed_cache.view(-1, num_pages // pages_per_block, pages_per_block * page_bytes)
    blocks[:, dst_block_offsets] = blocks[:, src_block_offsets]


def copy_state_slots(state_pool: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Copy whole state-pool rows (every recurrent layer's state at once)."""
    if src_slots.numel():
        state_pool[dst_slots] = state_pool[src_slots]
