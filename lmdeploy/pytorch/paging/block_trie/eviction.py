"""`TrieEviction`: frees KV blocks and state slots held by the prefix cache when the scheduler needs them.

Owns no resource and no priority: the priorities are `ReusePolicy`'s (eviction_policy.py), the heaps of evictable
checkpoints `StateCheckpointLifecycle`'s, the evictable leaves `TrieKVLifecycle`'s. This module only decides, under
KV pressure, which of the two candidates goes next (one order for partial checkpoints and trie leaves), and evicts a
leaf with everything that hangs on it. It must not evict what a running request or a pinned checkpoint holds: a
leaf goes only when the trie holds its block's only reference and each of its checkpoints is evictable.

Called by `BlockTrie.evict_blocks` / `evict_slot` (the prefix-cache contract, during `schedule`) and by
`CheckpointPolicy` when a reservation needs a slot or a frozen block.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from . import route_store
from .node import Node

if TYPE_CHECKING:
    from .block_trie import BlockTrie


class TrieEviction:

    def __init__(self, trie: BlockTrie):
        self.trie = trie
        self.block_manager = trie.block_manager
        self.kv = trie.kv
        self.checkpoints = trie.checkpoints
        self.reuse = trie.reuse
        self.misses = trie.misses

    def evict_blocks(self, num_needed: int) -> bool:
        """Free KV blocks until `num_needed` are free. Partial checkpoints (each frees its frozen block) and trie
        leaves (each frees its block, with its checkpoints) compete in one order: the lowest priority goes
        (eviction_policy.py; a partial checkpoint first on a tie)."""
        while not self.block_manager.can_allocate(num_needed):
            ck = self.checkpoints.peek(partial_only=True) if self.checkpoints is not None else None
            leaf = self.kv.peek_leaf(self.leaf_is_evictable)
            if ck is None and leaf is None:
                return False
            if ck is not None and (leaf is None or ck[0] <= leaf[0]):
                self.checkpoints.evict(ck[1], 'kv')
            else:
                self.evict_leaf(*leaf)
        return True

    def leaf_is_evictable(self, leaf: Node) -> bool:
        return self.block_manager.ref_count(leaf.block_id) == 1 and all(
            self.checkpoints.is_evictable(ck) for ck in leaf.checkpoints.values())

    def evict_lowest_leaf(self) -> bool:
        """Evict the lowest-priority evictable trie leaf; False when there is none."""
        leaf = self.kv.peek_leaf(self.leaf_is_evictable)
        if leaf is not None:
            self.evict_leaf(*leaf)
        return leaf is not None

    def evict_leaf(self, priority: float, leaf: Node) -> None:
        """Evict `leaf` (found at `priority`) with its checkpoints and the routes it keeps."""
        for ck in list(leaf.checkpoints.values()):
            self.checkpoints.evict(ck, 'kv_leaf')
        self.reuse.on_evicted(priority)
        self.misses.note_evicted_block(leaf.prefix_key)
        self.trie.held.routes_bytes -= route_store.block_bytes(leaf)
        self.kv.detach(leaf)

    def evict_slot(self) -> bool:
        """Free one state slot by evicting the lowest-priority unpinned checkpoint."""
        return self.checkpoints is not None and self.checkpoints.evict_one(partial_only=False, cause='state')
