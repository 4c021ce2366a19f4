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
    if not cache_config.enable_prefix_caching:
        return NullPrefixCache(state_manager)
    c = cache_config
    return BlockTrie(block_manager, state_manager, c.block_size, exact_steps=c.prefix_cache_exact_steps,
                     prompt_logits=c.prefix_cache_prompt_logits,
                     branch_checkpoints=c.prefix_cache_branch_checkpoints,
                     value_eviction=c.prefix_cache_value_eviction, state_row_bytes=c.state_row_bytes,
                     kv_block_bytes=c.kv_block_bytes, decode_state_interval=c.prefix_cache_decode_state_interval,
                     prefill_state_interval=c.prefix_cache_prefill_state_interval,
                     prefill_state_cap=c.prefix_cache_prefill_state_cap,
                     reply_checkpoints=c.prefix_cache_reply_checkpoints)
