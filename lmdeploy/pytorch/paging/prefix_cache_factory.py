"""Builds the scheduler's prefix cache from a `CacheConfig`: a `BlockTrie` with caching on, else a `NullPrefixCache`.

The one place that names the implementations; the scheduler sees only the contract (`prefix_cache.py`).
"""
from __future__ import annotations

from ..config import CacheConfig
from .block_manager import BlockManager
from .block_trie.block_trie import BlockTrie
from .null_prefix_cache import NullPrefixCache
from .prefix_cache import PrefixCache
from .state_manager import StateManager


def make_prefix_cache(cache_config: CacheConfig, block_manager: BlockManager,
                      state_manager: StateManager | None) -> PrefixCache:
    if cache_config.prefix_cache is None:
        return NullPrefixCache(state_manager)
    return BlockTrie(block_manager, state_manager, cache_config.block_size, config=cache_config.prefix_cache,
                     state_row_bytes=cache_config.state_row_bytes, kv_block_bytes=cache_config.kv_block_bytes)
