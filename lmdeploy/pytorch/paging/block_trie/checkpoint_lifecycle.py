"""State-checkpoint lifecycle: reserve -> publish -> (pin/unpin)* -> release; eviction picks among the unpinned.

Owns: every checkpoint record, its state slot and its frozen partial block (one KV ref each). A RESERVED record
holds resources for save copies that are not queued yet and is never evicted; a PUBLISHED one is matchable;
a pinned one (restore copies pending) is never evicted or released. The published, unpinned ones wait in two
heaps (partial, aligned) ordered by `ReusePolicy` priority (eviction_policy.py): state pressure takes the lowest of
either; KV pressure compares the lowest partial one with the lowest trie leaf (`BlockTrie.evict_blocks`). When a
partial checkpoint goes, an aligned checkpoint at its block floor on the same anchor (its fallback: the same prefix
up to the block boundary) inherits its hits. An evicted checkpoint's hits are remembered by its prefix (anchor
key, step, tail hash; the last `_MAX_GHOSTS` evictions): one computed again there for a prompt it would have served
carries them on.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable

from ..block_manager import BlockManager
from ..state_manager import StateManager
from .checkpoint_index import StateCheckpointIndex
from .eviction_policy import LazyMinHeap, ReusePolicy
from .node import CheckpointState, Node, NodeStateCheckpoint

# Evicted checkpoints whose hits are remembered (`StateCheckpointLifecycle.publish`).
_MAX_GHOSTS = 1 << 14


class StateCheckpointLifecycle:

    def __init__(self, block_manager: BlockManager, state_manager: StateManager, index: StateCheckpointIndex,
                 value_eviction: bool = False, state_row_bytes: int = 1, kv_block_bytes: int = 0,
                 policy: ReusePolicy | None = None):
        self.block_manager = block_manager
        self.state_manager = state_manager
        self.index = index
        self.policy = policy or ReusePolicy(lru=not value_eviction)
        self.state_row_bytes = max(state_row_bytes, 1)
        self.kv_block_bytes = kv_block_bytes
        # Called with every checkpoint released by eviction (miss attribution).
        self.on_evict: Callable[[NodeStateCheckpoint], None] | None = None
        # Called with the anchor whenever its set of checkpoints or one of their priorities changes (the trie
        # leaf's own priority follows them).
        self.on_change: Callable[[Node], None] | None = None
        self._live: set[NodeStateCheckpoint] = set()
        # Published and unpinned, by priority.
        self._partial: LazyMinHeap[NodeStateCheckpoint] = LazyMinHeap()
        self._aligned: LazyMinHeap[NodeStateCheckpoint] = LazyMinHeap()
        self.num_evicted = 0
        self.evictions_by_cause: Counter = Counter()
        # (anchor prefix key, step, tail hash) of recently evicted checkpoints -> their hits.
        self._ghosts: OrderedDict[tuple[int, int, int], int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._live)

    @property
    def num_published(self) -> int:
        return len(self.index)

    def reserve(self, ck: NodeStateCheckpoint) -> NodeStateCheckpoint:
        """Take ownership of a new RESERVED record's allocated slot and frozen block (its save copies are planned)."""
        assert ck.state == CheckpointState.RESERVED and ck.anchor is None
        self._live.add(ck)
        return ck

    def publish(self, ck: NodeStateCheckpoint, nodes: tuple[Node, ...], anchor: Node, now: int,
                revives: bool = False) -> None:
        """The save copies are queued: fix the anchor and its path `nodes` (empty for a root anchor) and make the
        checkpoint matchable. `revives`: it was computed for a prompt that a checkpoint at the same prefix would
        have served (its step lies within that prompt); if one was evicted there recently, the new one carries its
        hits on, plus the hit this prompt missed."""
        assert ck.state == CheckpointState.RESERVED
        assert (nodes[-1] if nodes else anchor) is anchor and anchor.attached
        ck.anchor, ck.nodes, ck.block_ids = anchor, nodes, tuple(n.block_id for n in nodes)
        ck.state = CheckpointState.PUBLISHED
        ck.last_access = now
        anchor.checkpoints[(ck.step, ck.tail_hash)] = ck
        anchor.add_continuation(ck.tail_bytes)
        self.index.add(ck)
        missed = self._ghosts.pop((anchor.prefix_key, ck.step, ck.tail_hash), None)
        if revives and missed is not None:
            ck.num_hits = max(ck.num_hits, missed + 1)
        self._reprioritise(ck)

    def pin(self, ck: NodeStateCheckpoint, now: int) -> None:
        ck.pin_count += 1
        ck.last_access = now
        self._heap(ck).discard(ck)

    def unpin(self, ck: NodeStateCheckpoint) -> None:
        assert ck.pin_count > 0, 'unpin without pin'
        ck.pin_count -= 1
        if ck.pin_count == 0 and ck.published:
            self._heap(ck).push(ck, ck.priority)

    def touch(self, ck: NodeStateCheckpoint, now: int) -> None:
        """A request was admitted on `ck` (a hit): one more observed reuse."""
        ck.last_access = now
        ck.num_hits += 1
        self._reprioritise(ck)

    def _heap(self, ck: NodeStateCheckpoint) -> LazyMinHeap[NodeStateCheckpoint]:
        return self._partial if ck.is_partial else self._aligned

    def _reprioritise(self, ck: NodeStateCheckpoint) -> None:
        """Priority as of now (a publication or a use); re-queued if evictable; the anchor's leaf follows."""
        ck.priority = self.policy.priority(ck.num_hits, ck.step, self.device_bytes(ck), ck.last_access)
        if ck.published and ck.pin_count == 0:
            self._heap(ck).push(ck, ck.priority)
        if ck.published and self.on_change is not None:
            self.on_change(ck.anchor)

    def release(self, ck: NodeStateCheckpoint) -> None:
        """Return the slot and frozen block; the record dies. Never called on a pinned checkpoint."""
        assert ck.pin_count == 0, 'release of a pinned checkpoint'
        if ck.state == CheckpointState.RELEASED:
            return
        if ck.published:
            self.index.remove(ck)
            if ck.anchor.checkpoints.get((ck.step, ck.tail_hash)) is ck:
                del ck.anchor.checkpoints[(ck.step, ck.tail_hash)]
            ck.anchor.remove_continuation(ck.tail_bytes)
        anchor, was_published = ck.anchor, ck.published
        ck.state = CheckpointState.RELEASED
        self._heap(ck).discard(ck)
        self._live.discard(ck)
        self.state_manager.free(ck.slot)
        if ck.frozen_block_id is not None:
            self.block_manager.free([ck.frozen_block_id])
        if was_published and self.on_change is not None:
            self.on_change(anchor)

    def device_bytes(self, ck: NodeStateCheckpoint) -> int:
        """Device memory the checkpoint holds (what eviction frees): its state row and its frozen block. Kept
        logits live on the host and compete for nothing on the device."""
        return self.state_row_bytes + (self.kv_block_bytes if ck.is_partial else 0)

    def bytes_held(self, ck: NodeStateCheckpoint) -> int:
        logits = getattr(ck.last_logits, 'nbytes', 0) if ck.last_logits is not None else 0
        return self.state_row_bytes + (self.kv_block_bytes if ck.is_partial else 0) + int(logits)

    def peek(self, partial_only: bool) -> tuple[float, NodeStateCheckpoint] | None:
        """The lowest-priority evictable checkpoint (only partial ones if asked) with its priority, or None."""
        found = [f for f in (self._partial.peek(), None if partial_only else self._aligned.peek()) if f is not None]
        return min(found, key=lambda f: f[0]) if found else None

    def evict_one(self, partial_only: bool, cause: str) -> bool:
        """Evict the lowest-priority evictable checkpoint (only partial ones if asked); False when there is none."""
        found = self.peek(partial_only)
        if found is None:
            return False
        self.evict(found[1], cause)
        return True

    def evict(self, ck: NodeStateCheckpoint, cause: str) -> None:
        assert ck.pin_count == 0 and ck.published, 'only published, unpinned checkpoints are evicted'
        if self.on_evict is not None:
            self.on_evict(ck)
        self.policy.on_evicted(ck.priority)
        self._ghosts[(ck.anchor.prefix_key, ck.step, ck.tail_hash)] = ck.num_hits
        if len(self._ghosts) > _MAX_GHOSTS:
            self._ghosts.popitem(last=False)
        fallback = self.fallback(ck) if ck.num_hits else None
        self.release(ck)
        self.num_evicted += 1
        self.evictions_by_cause[cause] += 1
        if fallback is not None:
            fallback.num_hits += ck.num_hits
            self._reprioritise(fallback)

    @staticmethod
    def fallback(ck: NodeStateCheckpoint) -> NodeStateCheckpoint | None:
        """The published aligned checkpoint at the block floor of a partial `ck` (same anchor, so the same prefix
        up to there): where `ck`'s hits resume once `ck` is gone. None for aligned or root-anchored ones."""
        if not ck.is_partial or not ck.published or ck.anchor.is_root:
            return None
        floor = ck.step - len(ck.tail_bytes) // 8
        return next((other for other in ck.anchor.checkpoints.values()
                     if other.step == floor and not other.is_partial and other.published), None)

    def is_evictable(self, ck: NodeStateCheckpoint) -> bool:
        return ck in self._partial or ck in self._aligned

    def verify(self, ck: NodeStateCheckpoint) -> bool:
        """A published record still refers to live trie nodes holding exactly its frozen block ids, and its
        recorded path is the anchor's path (what matching relies on instead of walking the trie)."""
        if not ck.published or not ck.anchor.attached:
            return False
        node, path = ck.anchor, []
        while not node.is_root:
            if not node.attached:
                return False
            path.append(node)
            node = node.parent
        path.reverse()
        return (tuple(n.block_id for n in path) == ck.block_ids and len(path) == len(ck.nodes)
                and all(a is b for a, b in zip(path, ck.nodes)))

    def owners(self) -> tuple[Counter, Counter]:
        """(KV block owners, state slot owners) held by checkpoints, for the integrity check."""
        blocks, slots = Counter(), Counter()
        for ck in self._live:
            slots[ck.slot] += 1
            if ck.frozen_block_id is not None:
                blocks[ck.frozen_block_id] += 1
        return blocks, slots

    def live(self) -> list[NodeStateCheckpoint]:
        return list(self._live)
