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
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ...messages import SchedulerSequence
from ..block_manager import BlockManager
from ..state_manager import StateManager
from .checkpoint_index import StateCheckpointIndex
from .checkpoint_lifecycle import StateCheckpointLifecycle
from .kv_lifecycle import TrieKVLifecycle
from .miss_tracker import MissTracker
from .node import MMIdentity, Node, NodeStateCheckpoint, block_hash, tail_hash


class PrefixMatch(NamedTuple):
    num_tokens: int                          # prompt tokens served from the cache (the resume step)
    nodes: list[Node]                        # shared full blocks [0, num_tokens // block_size)
    checkpoint: NodeStateCheckpoint | None   # state to restore (hybrid models), None for dense models
    # Branch point: the prompt shares this many tokens with cached ones but no checkpoint exists there; the first
    # prefill chunk ends exactly here so that a checkpoint is taken (0: none).
    junction: int = 0
    # Uncached prompt tokens by reason (see miss_tracker.py).
    miss: Counter | None = None


@dataclass
class PrefixCacheStats:
    num_requests: int = 0
    num_hits: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    checkpoints_saved: int = 0
    logits_hits: int = 0
    branch_points: int = 0
    miss_reasons: Counter = field(default_factory=Counter)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


def mm_identity_of(seq: SchedulerSequence, start: int, end: int) -> MMIdentity:
    """Multimodal spans overlapping `[start, end)`, relative to `start`."""
    return tuple((max(s.start, start) - start, min(s.end, end) - start, s.content_hash)
                 for s in seq.mm_spans if s.start < end and s.end > start)


class BlockTrie:

    def __init__(self, block_manager: BlockManager, state_manager: StateManager | None, block_size: int,
                 exact_steps: bool = True, prompt_logits: bool = False, branch_checkpoints: bool = False,
                 value_eviction: bool = False, state_row_bytes: int = 1, kv_block_bytes: int = 0):
        self.block_manager = block_manager
        self.state_manager = state_manager
        self.block_size = block_size
        self.is_hybrid = state_manager is not None
        self.exact_steps = exact_steps
        self.prompt_logits = prompt_logits
        self.branch_checkpoints = branch_checkpoints
        self.kv = TrieKVLifecycle(block_manager, block_size)
        self.index = StateCheckpointIndex()
        self.checkpoints = StateCheckpointLifecycle(
            block_manager, state_manager, self.index, value_eviction=value_eviction,
            state_row_bytes=state_row_bytes, kv_block_bytes=kv_block_bytes) if state_manager is not None else None
        self.misses = MissTracker()
        if self.checkpoints is not None:
            self.checkpoints.on_evict = lambda ck: self.misses.note_evicted_checkpoint(ck.anchor.hash)
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

    def match(self, seq: SchedulerSequence, peers: list[SchedulerSequence] = ()) -> PrefixMatch:
        """The deepest reusable prefix of `seq`. At least one token is left to compute, except for a hybrid prompt
        whose prompt-end checkpoint kept its logits (an identical prompt then needs no forward at all).

        `peers` are sequences in flight (not yet in the trie): a prefix shared with one of them is a branch point
        too, so that concurrent requests with a common prefix leave a checkpoint for the ones that follow."""
        tokens = self._tokens(seq)
        n = len(tokens)
        path = self._match_path(seq, tokens, n // self.block_size)
        mm_limited = 0
        if not self.is_hybrid:
            depth = min(len(path), (n - 1) // self.block_size)
            while depth and not seq.is_prefix_cache_boundary_safe(depth * self.block_size):
                depth -= 1
                mm_limited = min(len(path), (n - 1) // self.block_size) * self.block_size
            ck, hit = None, depth * self.block_size
        else:
            ck, mm_limited = self._find_checkpoint(seq, tokens, path, n if self.prompt_logits else n - 1)
            hit = ck.step if ck is not None else 0
        covered, evicted_until = self._coverage(seq, tokens, path)
        junction = 0
        if self.branch_checkpoints and self.is_hybrid:
            junction = self._junction(seq, max(covered, self._peer_coverage(seq, tokens, peers, hit)), hit)
        miss = self._attribute(seq, tokens, path, hit, covered, evicted_until, mm_limited)
        return PrefixMatch(hit, path[:hit // self.block_size], ck, junction, miss)

    def _find_checkpoint(self, seq: SchedulerSequence, tokens: np.ndarray, path: list[Node], max_step: int
                         ) -> tuple[NodeStateCheckpoint | None, int]:
        """The deepest verified, usable checkpoint, and the deepest verified step rejected for a multimodal span."""
        anchors = np.array([self.kv.root(seq.adapter_name).hash] + [n.hash for n in path], dtype=np.uint64)
        path_ids = tuple(n.block_id for n in path)
        n, mm_limited = len(tokens), 0
        for ck in self.index.candidates(seq.adapter_name, anchors, max_step=max_step):
            step = ck.step
            if step // self.block_size > len(path) or (step == n and ck.last_logits is None):
                continue
            start = self._tail_start(step)
            mm = mm_identity_of(seq, start, step)
            th = tail_hash(tokens[start:step], mm)
            if ck.tail_hash != th or ck not in self.index.lookup((seq.adapter_name, step, th)):
                continue
            # A hash never proves a hit: verify the frozen data exactly.
            if not (ck.mm_identity == mm and ck.block_ids == path_ids[:step // self.block_size]
                    and np.array_equal(ck.token_ids, tokens[:step])):
                continue
            if not seq.is_prefix_cache_boundary_safe(step):
                mm_limited = max(mm_limited, step)
                continue
            return ck, mm_limited
        return None, mm_limited

    def _coverage(self, seq: SchedulerSequence, tokens: np.ndarray, path: list[Node]) -> tuple[int, int]:
        """(tokens of the prompt present in the trie: matched blocks plus the longest common prefix with a child
        block or a checkpoint tail of the last matched node; the end of a run of evicted blocks after that)."""
        bs, base = self.block_size, len(path) * self.block_size
        parent = path[-1] if path else self.kv.root(seq.adapter_name)
        rest = tokens[base:base + bs]
        covered = base
        if rest.size and parent.children:
            children = np.stack([c.token_ids for c in parent.children.values()])[:, :rest.size]
            same = children == rest[None, :]
            lcp = np.where(same.all(axis=1), rest.size, same.argmin(axis=1))
            covered = base + int(lcp.max())
        for ck in parent.checkpoints.values():
            tail, mine = ck.token_ids[base:], tokens[base:]
            m = min(tail.size, mine.size)
            same = tail[:m] == mine[:m]
            covered = max(covered, base + (m if same.all() else int(same.argmin())))
        evicted_until, h = base, parent.hash
        while covered == base and evicted_until + bs <= len(tokens):
            h = block_hash(h, tokens[evicted_until:evicted_until + bs],
                           mm_identity_of(seq, evicted_until, evicted_until + bs))
            if h not in self.misses.evicted_blocks:
                break
            evicted_until += bs
        return min(covered, len(tokens)), evicted_until

    def _peer_coverage(self, seq: SchedulerSequence, tokens: np.ndarray, peers, hit: int) -> int:
        """The branch point shared with in-flight or queued sequences of the same adapter: among their common
        prefixes with this prompt deeper than `hit`, the one serving the most tokens (its length times the peers
        reaching it), the deeper on a tie. A peer holding the whole prompt is left out when the prompt-end
        checkpoint serves it (it is longer, or identical with kept logits)."""
        lcps = []
        head = min(self.block_size, len(tokens))
        for peer in peers:
            if peer is seq or peer.adapter_name != seq.adapter_name or peer.token_ids[:head] != seq.token_ids[:head]:
                continue
            other = np.asarray(peer.token_ids[:len(tokens)], dtype=np.int64)
            same = other == tokens[:other.size]
            lcp = other.size if same.all() else int(same.argmin())
            if lcp > hit and not (lcp == len(tokens) and (self.prompt_logits or peer.num_tokens > lcp)):
                lcps.append(lcp)
        lcps.sort(reverse=True)
        return max(((lcp * (i + 1), lcp) for i, lcp in enumerate(lcps)), default=(0, 0))[1]

    def _junction(self, seq: SchedulerSequence, covered: int, hit: int) -> int:
        """Where this prompt diverges from cached ones (a branch point to checkpoint), or 0."""
        junction = min(covered, seq.num_tokens - 1)
        if not self.exact_steps:
            junction -= junction % self.block_size
        while junction > hit and not seq.is_prefix_cache_boundary_safe(junction):
            junction -= 1
        return junction if junction > hit else 0

    def _attribute(self, seq: SchedulerSequence, tokens: np.ndarray, path: list[Node], hit: int, covered: int,
                   evicted_until: int, mm_limited: int) -> Counter:
        root = self.kv.root(seq.adapter_name)
        first, last = hit // self.block_size, min(covered, len(tokens)) // self.block_size
        gap_anchors = [(path[d - 1] if d else root).hash for d in range(first, min(last, len(path)) + 1)]
        other = 0
        if len(self.kv.roots) > 1 and len(tokens) >= self.block_size:
            block = tokens[:self.block_size]
            mm = mm_identity_of(seq, 0, self.block_size)
            if any(self.kv.find_child(r, block, mm) for a, r in self.kv.roots.items() if a != seq.adapter_name):
                other = self.block_size
        return self.misses.attribute(len(tokens), hit, covered, evicted_until, mm_limited, gap_anchors, other)

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
            self.stats.logits_hits += int(match.num_tokens == seq.num_tokens)
            self.stats.branch_points += int(match.junction > 0)
            if match.miss:
                self.stats.miss_reasons.update(match.miss)

    def on_released(self, seq: SchedulerSequence) -> None:
        self._paths.pop(seq.seq_id, None)

    # ---- attaching blocks -------------------------------------------------------------------------------------
    def attach(self, seq: SchedulerSequence) -> list[Node]:
        """Attach the sequence's computed full blocks to the trie; returns its canonical path."""
        path = self._paths.setdefault(seq.seq_id, [])
        # Nodes the sequence deduplicated its own blocks onto hold no reference of the sequence, so they may have been
        # evicted since. Only leaves are evicted, so evicted nodes form a suffix of the path: drop it and attach the
        # sequence's own blocks again (never hang new nodes off a detached one).
        while path and not path[-1].attached:
            path.pop()
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
            if node.block_id != seq.block_ids[i]:
                # The trie already holds this block (computed by another request): adopt it and free the private
                # duplicate. The block is full, so it is never written again; holding a reference keeps the node
                # from being evicted under the running request (else it could become an unevictable interior node
                # over the request's own blocks).
                self.block_manager.add_ref([node.block_id])
                self.block_manager.free([seq.block_ids[i]])
                seq.block_ids[i] = node.block_id
            node.last_access = now
            self.misses.note_attached_block(node.hash)
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

    def note_skipped_checkpoint(self, seq: SchedulerSequence, step: int) -> None:
        """A wanted checkpoint could not be reserved (no slot or block): remember its anchor for miss reasons."""
        depth = step // self.block_size
        path = self._paths.get(seq.seq_id, [])
        if depth <= len(path):
            anchor = path[depth - 1].hash if depth else self.kv.root(seq.adapter_name).hash
        else:
            anchor, tokens = self.kv.root(seq.adapter_name).hash, self._tokens(seq)
            for i in range(depth):
                lo, hi = i * self.block_size, (i + 1) * self.block_size
                anchor = block_hash(anchor, tokens[lo:hi], mm_identity_of(seq, lo, hi))
        self.misses.note_skipped_checkpoint(anchor)

    def publish_checkpoint(self, seq: SchedulerSequence, ck: NodeStateCheckpoint) -> None:
        """Publish after the save copies are queued; a duplicate or an unattachable path releases it instead."""
        path = self.attach(seq)
        depth = ck.step // self.block_size
        if len(path) < depth:
            self.checkpoints.release(ck)
            return
        anchor = path[depth - 1] if depth else self.kv.root(seq.adapter_name)
        # The anchor keeps one checkpoint per (step, tail hash): a duplicate, or a tail-hash collision, is dropped
        # (replacing the key would orphan the existing checkpoint from its anchor and from leaf eviction).
        if (ck.step, ck.tail_hash) in anchor.checkpoints:
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
                    self.checkpoints.evict(ck, 'kv_leaf')
                self.misses.note_evicted_block(leaf.hash)
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
