"""`BlockTrie`: the prefix cache facade the scheduler talks to (match, admit helpers, attach, checkpoints, evict).

Owns the trie (via `TrieKVLifecycle`), the checkpoints (via `StateCheckpointLifecycle` and its index) and each
running sequence's canonical path (the trie nodes of its leading full blocks). It never touches device memory:
it returns copy plans as pairs of logical ids for the inputs maker.

Order per forward: scheduler admission calls `match` (then pins / allocates / rolls back); `plan_checkpoint`
reserves save targets for prefill and chunk ends; after the forward is queued `after_forward` attaches newly
completed blocks, publishes the reserved checkpoints and drops restore pins.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ...messages import SchedulerSequence
from ..block_manager import BlockManager
from ..state_manager import StateManager
from .checkpoint_index import StateCheckpointIndex
from .checkpoint_lifecycle import StateCheckpointLifecycle
from .kv_lifecycle import TrieKVLifecycle
from .node import MMIdentity, Node, NodeStateCheckpoint, tail_hash


class PrefixMatch(NamedTuple):
    num_tokens: int                          # prompt tokens served from the cache (the resume step)
    nodes: list[Node]                        # shared full blocks [0, num_tokens // block_size)
    checkpoint: NodeStateCheckpoint | None   # state to restore (hybrid models), None for dense models


@dataclass
class PrefixCacheStats:
    num_requests: int = 0
    num_hits: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    checkpoints_saved: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


def mm_identity_of(seq: SchedulerSequence, start: int, end: int) -> MMIdentity:
    """Multimodal spans overlapping `[start, end)`, relative to `start`."""
    return tuple((max(s.start, start) - start, min(s.end, end) - start, s.content_hash)
                 for s in seq.mm_spans if s.start < end and s.end > start)


class BlockTrie:

    def __init__(self, block_manager: BlockManager, state_manager: StateManager | None, block_size: int,
                 exact_steps: bool = True):
        self.block_manager = block_manager
        self.state_manager = state_manager
        self.block_size = block_size
        self.is_hybrid = state_manager is not None
        self.exact_steps = exact_steps
        self.kv = TrieKVLifecycle(block_manager, block_size)
        self.index = StateCheckpointIndex()
        self.checkpoints = StateCheckpointLifecycle(block_manager, state_manager, self.index) \
            if state_manager is not None else None
        self.stats = PrefixCacheStats()
        self._paths: dict[int, list[Node]] = {}
        self._clock = 0

    def tick(self) -> int:
        self._clock += 1
        return self._clock

    # ---- matching ---------------------------------------------------------------------------------------------
    def _tokens(self, seq: SchedulerSequence) -> np.ndarray:
        return np.asarray(seq.token_ids, dtype=np.int64)

    def _match_path(self, seq: SchedulerSequence, tokens: np.ndarray, max_blocks: int) -> list[Node]:
        """Trie nodes of the longest cached run of the sequence's leading full blocks (chained hash lookups)."""
        node, path, bs = self.kv.root(seq.adapter_name), [], self.block_size
        for i in range(max_blocks):
            block = tokens[i * bs:(i + 1) * bs]
            node = self.kv.find_child(node, block, mm_identity_of(seq, i * bs, (i + 1) * bs))
            if node is None:
                break
            path.append(node)
        return path

    def match(self, seq: SchedulerSequence) -> PrefixMatch:
        """The deepest reusable prefix of `seq`, always leaving at least one token to compute."""
        tokens = self._tokens(seq)
        limit = len(tokens) - 1
        path = self._match_path(seq, tokens, limit // self.block_size if not self.is_hybrid
                                else len(tokens) // self.block_size)
        if not self.is_hybrid:
            depth = len(path)
            while depth and not seq.is_prefix_cache_boundary_safe(depth * self.block_size):
                depth -= 1
            return PrefixMatch(depth * self.block_size, path[:depth], None)
        ck = self._find_checkpoint(seq, tokens, path, limit)
        if ck is None:
            return PrefixMatch(0, [], None)
        return PrefixMatch(ck.step, path[:ck.step // self.block_size], ck)

    def _find_checkpoint(self, seq: SchedulerSequence, tokens: np.ndarray, path: list[Node], limit: int
                         ) -> NodeStateCheckpoint | None:
        anchors = np.array([self.kv.root(seq.adapter_name).hash] + [n.hash for n in path], dtype=np.uint64)
        path_ids = tuple(n.block_id for n in path)
        for ck in self.index.candidates(seq.adapter_name, anchors, max_step=limit):
            step = ck.step
            if step // self.block_size > len(path) or not seq.is_prefix_cache_boundary_safe(step):
                continue
            start = self._tail_start(step)
            mm = mm_identity_of(seq, start, step)
            th = tail_hash(tokens[start:step], mm)
            if ck.tail_hash != th or ck not in self.index.lookup((seq.adapter_name, step, th)):
                continue
            # A hash never proves a hit: verify the frozen data exactly.
            if (ck.mm_identity == mm and ck.block_ids == path_ids[:step // self.block_size]
                    and np.array_equal(ck.token_ids, tokens[:step])):
                return ck
        return None

    def _tail_start(self, step: int) -> int:
        rem = step % self.block_size
        return step - rem if rem else step - self.block_size

    # ---- admission bookkeeping --------------------------------------------------------------------------------
    def on_admitted(self, seq: SchedulerSequence, match: PrefixMatch, first_admission: bool) -> None:
        now = self.tick()
        self._paths[seq.seq_id] = list(match.nodes)
        self.kv.touch_path(match.nodes, now)
        if match.checkpoint is not None:
            self.checkpoints.touch(match.checkpoint, now)
        if first_admission:
            self.stats.num_requests += 1
            self.stats.query_tokens += seq.num_prompt_tokens
            self.stats.hit_tokens += match.num_tokens
            self.stats.num_hits += int(match.num_tokens > 0)

    def on_released(self, seq: SchedulerSequence) -> None:
        self._paths.pop(seq.seq_id, None)

    # ---- attaching blocks -------------------------------------------------------------------------------------
    def attach(self, seq: SchedulerSequence) -> list[Node]:
        """Attach the sequence's computed full blocks to the trie; returns its canonical path."""
        path = self._paths.setdefault(seq.seq_id, [])
        num_full = seq.num_computed // self.block_size
        if len(path) >= num_full:
            return path
        tokens = self._tokens(seq)
        parent = path[-1] if path else self.kv.root(seq.adapter_name)
        now = self.tick()
        bs = self.block_size
        for i in range(len(path), num_full):
            node = self.kv.attach(parent, seq.block_ids[i], tokens[i * bs:(i + 1) * bs],
                                  mm_identity_of(seq, i * bs, (i + 1) * bs), now)
            if node is None:
                break
            node.last_access = now
            path.append(node)
            parent = node
        return path

    # ---- checkpoints ------------------------------------------------------------------------------------------
    def wants_checkpoint(self, seq: SchedulerSequence, step: int) -> bool:
        if not self.is_hybrid or step <= 0 or not seq.is_prefix_cache_boundary_safe(step):
            return False
        if not self.exact_steps and step % self.block_size:
            return False
        tokens = self._tokens(seq)[:step]
        start = self._tail_start(step)
        key = (seq.adapter_name, step, tail_hash(tokens[start:step], mm_identity_of(seq, start, step)))
        return not any(np.array_equal(ck.token_ids, tokens) for ck in self.index.lookup(key))

    def reserve_checkpoint(self, seq: SchedulerSequence, step: int, slot: int, frozen_block_id: int | None
                           ) -> NodeStateCheckpoint:
        tokens = self._tokens(seq)[:step].copy()
        start = self._tail_start(step)
        mm = mm_identity_of(seq, start, step)
        return self.checkpoints.reserve(slot, frozen_block_id, step, seq.adapter_name, tokens, mm,
                                        tail_hash(tokens[start:step], mm), self.tick())

    def publish_checkpoint(self, seq: SchedulerSequence, ck: NodeStateCheckpoint) -> None:
        """Publish after the save copies are queued; a duplicate or an unattachable path releases it instead."""
        path = self.attach(seq)
        depth = ck.step // self.block_size
        if len(path) < depth:
            self.checkpoints.release(ck)
            return
        anchor = path[depth - 1] if depth else self.kv.root(seq.adapter_name)
        existing = anchor.checkpoints.get((ck.step, ck.tail_hash))
        if existing is not None and np.array_equal(existing.token_ids, ck.token_ids):
            self.checkpoints.release(ck)
            return
        self.checkpoints.publish(ck, anchor, tuple(n.block_id for n in path[:depth]), self.tick())
        self.stats.checkpoints_saved += 1

    # ---- eviction ---------------------------------------------------------------------------------------------
    def evict_blocks(self, num_needed: int) -> bool:
        """Free KV blocks until `num_needed` are free: partial checkpoints first (LRU), then trie leaves (LRU)."""
        while not self.block_manager.can_allocate(num_needed):
            if self.checkpoints is not None and self.checkpoints.evict_one(partial_only=True, cause='kv'):
                continue
            if not self._evict_leaf():
                return False
        return True

    def _evict_leaf(self) -> bool:
        for leaf in self.kv.evictable_leaves():
            cks = list(leaf.checkpoints.values())
            if all(self.checkpoints.is_evictable(ck) for ck in cks):
                for ck in cks:
                    self.checkpoints.release(ck)
                    self.checkpoints.num_evicted += 1
                    self.checkpoints.evictions_by_cause['kv_leaf'] += 1
                self.kv.detach(leaf)
                return True
        return False

    def evict_slot(self) -> bool:
        """Free one state slot by releasing the least recently used unpinned checkpoint."""
        return self.checkpoints is not None and self.checkpoints.evict_one(partial_only=False, cause='state')

    # ---- invariants -------------------------------------------------------------------------------------------
    def owners(self) -> tuple[Counter, Counter]:
        blocks = self.kv.owners()
        slots: Counter = Counter()
        if self.checkpoints is not None:
            ck_blocks, slots = self.checkpoints.owners()
            blocks.update(ck_blocks)
        return blocks, slots

    @property
    def num_checkpoints(self) -> int:
        return self.checkpoints.num_published if self.checkpoints is not None else 0
