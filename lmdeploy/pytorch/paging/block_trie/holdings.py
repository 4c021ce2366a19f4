"""`CacheHoldings`: running counts of what the prefix cache holds, so that `BlockTrie.snapshot` and `routes_bytes`
are O(1) instead of a walk.

The counts change only where what they count changes: a checkpoint's publication, its kept logits and its eviction
(the only way a published checkpoint dies), and routed experts kept with a block or a checkpoint tail and dropped
with their owner (route_store.py). `check` compares every count with a recount from the live checkpoints and a walk
of the trie (`BlockTrie.check_integrity`). Owns no resource; it never frees or evicts anything.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .node import NodeStateCheckpoint


@dataclass(slots=True)
class CacheHoldings:
    checkpoint_bytes: int = 0      # bytes the published checkpoints hold (state row, frozen block, kept logits)
    num_partial: int = 0           # published checkpoints with a frozen partial block
    routes_bytes: int = 0          # host bytes of routed experts kept by nodes and published checkpoints
    # Published checkpoints still live that were published after the last `mark()` (a benchmark's window).
    since_mark: set[NodeStateCheckpoint] = field(default_factory=set)
    partial_since_mark: int = 0

    def on_published(self, ck: NodeStateCheckpoint, nbytes: int) -> None:
        self.checkpoint_bytes += nbytes
        self.num_partial += ck.is_partial
        self.since_mark.add(ck)
        self.partial_since_mark += ck.is_partial

    def on_evicted(self, ck: NodeStateCheckpoint, nbytes: int, routes_nbytes: int) -> None:
        self.checkpoint_bytes -= nbytes
        self.routes_bytes -= routes_nbytes
        self.num_partial -= ck.is_partial
        if ck in self.since_mark:
            self.since_mark.discard(ck)
            self.partial_since_mark -= ck.is_partial

    def mark(self) -> None:
        self.since_mark, self.partial_since_mark = set(), 0

    def check(self, published: list[NodeStateCheckpoint], checkpoint_bytes: int, routes_bytes: int) -> None:
        """Each count equals its recount: `checkpoint_bytes` and `routes_bytes` as recounted by the caller."""
        assert self.routes_bytes == routes_bytes, 'route bytes drifted'
        partial = sum(ck.is_partial for ck in published)
        assert (self.checkpoint_bytes, self.num_partial) == (checkpoint_bytes, partial), \
            'checkpoint byte accounting drifted'
        assert self.since_mark <= set(published), 'an evicted checkpoint is still counted since the mark'
        assert self.partial_since_mark == sum(ck.is_partial for ck in self.since_mark)
