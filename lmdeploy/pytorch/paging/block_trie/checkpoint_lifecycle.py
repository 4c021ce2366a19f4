"""State-checkpoint lifecycle: reserve -> publish -> (pin/unpin)* -> release; eviction picks among the unpinned.

Owns: every checkpoint record, its state slot and its frozen partial block (one KV ref each). A RESERVED record
holds resources for save copies that are not queued yet and is never evicted; a PUBLISHED one is matchable;
a pinned one (restore copies pending) is never evicted or released. Eviction order: least recently used first;
under KV pressure only partial (frozen-block) checkpoints are candidates here, before any trie leaf.
"""
from __future__ import annotations

from collections import Counter, OrderedDict

from ..block_manager import BlockManager
from ..state_manager import StateManager
from .checkpoint_index import StateCheckpointIndex
from .node import CheckpointState, Node, NodeStateCheckpoint

_VALUE_WINDOW = 16


class StateCheckpointLifecycle:

    def __init__(self, block_manager: BlockManager, state_manager: StateManager, index: StateCheckpointIndex,
                 value_eviction: bool = False, state_row_bytes: int = 1, kv_block_bytes: int = 0):
        self.block_manager = block_manager
        self.state_manager = state_manager
        self.index = index
        # Eviction by value: among the `_VALUE_WINDOW` least recently used candidates, evict the one that saves the
        # least compute (tokens skipped) per byte held (state row + frozen block + kept logits).
        self.value_eviction = value_eviction
        self.state_row_bytes = max(state_row_bytes, 1)
        self.kv_block_bytes = kv_block_bytes
        # Called with every checkpoint released by eviction (miss attribution).
        self.on_evict = None
        self._live: set[NodeStateCheckpoint] = set()
        # Published and unpinned, least recently used first.
        self._evictable: OrderedDict[NodeStateCheckpoint, None] = OrderedDict()
        self.num_evicted = 0
        self.evictions_by_cause: Counter = Counter()

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

    def publish(self, ck: NodeStateCheckpoint, nodes: tuple[Node, ...], anchor: Node, now: int) -> None:
        """The save copies are queued: fix the anchor and its path `nodes` (empty for a root anchor) and make the
        checkpoint matchable."""
        assert ck.state == CheckpointState.RESERVED
        assert (nodes[-1] if nodes else anchor) is anchor and anchor.attached
        ck.anchor, ck.nodes, ck.block_ids = anchor, nodes, tuple(n.block_id for n in nodes)
        ck.state = CheckpointState.PUBLISHED
        ck.last_access = now
        anchor.checkpoints[(ck.step, ck.tail_hash)] = ck
        anchor.add_continuation(ck.tail_bytes)
        self.index.add(ck)
        if ck.pin_count == 0:
            self._evictable[ck] = None

    def pin(self, ck: NodeStateCheckpoint, now: int) -> None:
        ck.pin_count += 1
        ck.last_access = now
        self._evictable.pop(ck, None)

    def unpin(self, ck: NodeStateCheckpoint) -> None:
        assert ck.pin_count > 0, 'unpin without pin'
        ck.pin_count -= 1
        if ck.pin_count == 0 and ck.published:
            self._evictable[ck] = None
            self._evictable.move_to_end(ck)

    def touch(self, ck: NodeStateCheckpoint, now: int) -> None:
        ck.last_access = now
        if ck in self._evictable:
            self._evictable.move_to_end(ck)

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
        ck.state = CheckpointState.RELEASED
        self._evictable.pop(ck, None)
        self._live.discard(ck)
        self.state_manager.free(ck.slot)
        if ck.frozen_block_id is not None:
            self.block_manager.free([ck.frozen_block_id])

    def bytes_held(self, ck: NodeStateCheckpoint) -> int:
        logits = getattr(ck.last_logits, 'nbytes', 0) if ck.last_logits is not None else 0
        return self.state_row_bytes + (self.kv_block_bytes if ck.is_partial else 0) + int(logits)

    def value(self, ck: NodeStateCheckpoint) -> float:
        """Compute saved per byte held: the tokens a hit skips over the bytes the checkpoint holds."""
        return ck.step / self.bytes_held(ck)

    def evict_one(self, partial_only: bool, cause: str) -> bool:
        """Release one unpinned published checkpoint (only partial ones if asked): the least recently used, or
        with value eviction the lowest-value one among the least recently used few."""
        victim, window = None, []
        for ck in self._evictable:
            if partial_only and not ck.is_partial:
                continue
            if not self.value_eviction:
                victim = ck
                break
            window.append(ck)
            if len(window) == _VALUE_WINDOW:
                break
        if window:
            victim = min(window, key=self.value)
        if victim is None:
            return False
        self.evict(victim, cause)
        return True

    def evict(self, ck: NodeStateCheckpoint, cause: str) -> None:
        if self.on_evict is not None:
            self.on_evict(ck)
        self.release(ck)
        self.num_evicted += 1
        self.evictions_by_cause[cause] += 1

    def is_evictable(self, ck: NodeStateCheckpoint) -> bool:
        return ck in self._evictable

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
