"""How many KV blocks and state rows the cache pools get: a pure function of byte sizes and the config.

Owns no memory; `Engine` asks the device how much is free and allocates what this returns (`CacheEngine`).

The state pool of a hybrid model holds row 0 (a dummy), one runtime row per running sequence, one spare row for
the batch being scheduled, and `num_checkpoint_rows` rows only checkpoints use (idle runtime rows serve them too).
With prefix caching the checkpoint rows are sized like the KV pool, as a share of the cache memory:

    cache = (free - runtime rows) * cache_max_entry_count
    checkpoint rows = cache * prefix_cache_state_ratio // row bytes
    KV blocks = (cache - checkpoint rows * row bytes) // block bytes

unless the config fixes them: `prefix_cache_state_budget > 0` is an exact number of checkpoint rows, and a fixed
`num_gpu_blocks` (no memory sizing) keeps only that budget.
"""
from __future__ import annotations

from typing import NamedTuple


class CachePlan(NamedTuple):
    num_blocks: int           # KV blocks of block_size tokens
    num_state_slots: int      # state-pool rows in all (0 for dense models)
    num_checkpoint_rows: int  # of which only checkpoints use


def plan_cache(*, free_bytes: int, block_bytes: int, row_bytes: int, is_hybrid: bool, max_batch_size: int,
               cache_max_entry_count: float, num_gpu_blocks: int = 0, state_budget: int = 0,
               state_ratio: float = 0.0, prefix_caching: bool = False) -> CachePlan:
    """Pool sizes for `free_bytes` of device memory (see the module docstring)."""
    runtime_rows = 1 + max_batch_size + 1 if is_hybrid else 0
    rows = state_budget if is_hybrid else 0
    if num_gpu_blocks:
        return CachePlan(num_gpu_blocks, runtime_rows + rows if is_hybrid else 0, rows)
    if rows:
        cache = int((free_bytes - (runtime_rows + rows) * row_bytes) * cache_max_entry_count)
        return CachePlan(max(cache, 0) // block_bytes, runtime_rows + rows, rows)
    cache = max(int((free_bytes - runtime_rows * row_bytes) * cache_max_entry_count), 0)
    if is_hybrid and prefix_caching and state_ratio > 0:
        rows = int(cache * state_ratio) // row_bytes
    return CachePlan((cache - rows * row_bytes) // block_bytes, runtime_rows + rows, rows)
