"""`BlockTrie`: the prefix cache, implementing the contract of `paging/prefix_cache.py` (read that first).

Owns the trie (via `TrieKVLifecycle`), the checkpoints (via `StateCheckpointLifecycle` and its index) and each
running sequence's canonical path (the trie nodes of its leading full blocks). It never touches device memory:
it returns copy plans as pairs of logical ids for the inputs maker. Which steps get checkpoints, and from where
their slots come, is `CheckpointPolicy`'s (checkpoint_policy.py), what to evict `TrieEviction`'s (eviction.py);
this file matches, attaches and publishes.

Order per step (the contract's): `match` -> `acquire` / `rollback` -> `record_admission` during `schedule`;
`plan_checkpoints` at its end; after the forward is queued `commit` attaches newly completed blocks, publishes the
reserved checkpoints, drops restore pins and keeps prompt logits; `plan_replies` -> `publish` / `discard`.
"""
from __future__ import annotations

import time
from collections import Counter
from types import MappingProxyType

import numpy as np

from ....prefix_cache_config import PrefixCacheConfig
from ...messages import SchedulerSequence
from ..block_manager import BlockManager
from ..prefix_cache import PrefixCache, PrefixCacheSnapshot, PrefixCacheStats, PrefixMatch, PromptLogits
from ..scheduler_output import CopyPlan, LogitsHit, SchedulerOutput
from ..state_manager import StateManager
from . import route_store
from .checkpoint_index import StateCheckpointIndex
from .checkpoint_lifecycle import StateCheckpointLifecycle
from .checkpoint_policy import CheckpointPolicy, cap_at_hint
from .coverage import PromptCoverage
from .eviction import TrieEviction
from .eviction_policy import ReusePolicy
from .holdings import CacheHoldings
from .kv_lifecycle import TrieKVLifecycle
from .miss_tracker import MissTracker
from .node import Node, NodeStateCheckpoint, tail_hash
from .prefix_keys import PrefixHasher, equal_tokens, mm_identity_of

# Token bytes compared at once when verifying a run of trie nodes (keeps temporaries small).
_VERIFY_BYTES = 1 << 14


__all__ = ['BASE_DESIGN', 'BlockTrie', 'PrefixCacheStats', 'PrefixMatch']

# Checkpoints at prefill and chunk ends of any step, plain LRU: every policy on top switched off.
BASE_DESIGN = PrefixCacheConfig(reply_checkpoints=False, prompt_logits=False, branch_checkpoints=False,
                                value_eviction=False, prefill_state_interval=0)


class BlockTrie(PrefixCache):

    def __init__(self, block_manager: BlockManager, state_manager: StateManager | None, block_size: int,
                 config: PrefixCacheConfig = BASE_DESIGN, state_row_bytes: int = 1, kv_block_bytes: int = 0):
        """`config`: the knobs, resolved to `block_size` (`PrefixCacheConfig.resolved`)."""
        self.config = config
        self.block_manager = block_manager
        self.state_manager = state_manager
        self.block_size = block_size
        self.is_hybrid = state_manager is not None
        self.exact_steps = config.exact_steps
        self.prompt_logits = config.prompt_logits
        self.branch_checkpoints = config.branch_checkpoints
        self.hasher = PrefixHasher(block_size)
        # Eviction priorities (eviction_policy.py); `policy` below is where checkpoints are taken.
        self.reuse = ReusePolicy(lru=not config.value_eviction)
        self.kv = TrieKVLifecycle(block_manager, block_size, self.hasher, self.reuse, kv_block_bytes,
                                  hybrid=self.is_hybrid)
        self.index = StateCheckpointIndex(self.hasher.stride)
        self.checkpoints = StateCheckpointLifecycle(
            block_manager, state_manager, self.index, state_row_bytes=state_row_bytes, kv_block_bytes=kv_block_bytes,
            policy=self.reuse) if state_manager is not None else None
        self.misses = MissTracker()
        if self.checkpoints is not None:
            self.checkpoints.on_evict = self._on_evict
            self.checkpoints.on_change = self.kv.refresh
        self.stats = PrefixCacheStats()
        self.held = CacheHoldings()  # running counts of checkpoint and route bytes (holdings.py)
        self._paths: dict[int, list[Node]] = {}
        # Branch point of each admitted sequence: a checkpoint reserved there starts with one observed reuse (the
        # cached prompt it was found in shares it).
        self._junctions: dict[int, int] = {}
        self._clock = 0
        self.policy = CheckpointPolicy(self, block_manager, state_manager, config)
        self.coverage = PromptCoverage(self)
        self.eviction = TrieEviction(self)

    def tick(self) -> int:
        self._clock += 1
        return self._clock

    # ---- matching ---------------------------------------------------------------------------------------------
    def match(self, seq: SchedulerSequence, peers: list[SchedulerSequence] = ()) -> PrefixMatch:
        start = time.thread_time()
        try:
            return self._match(seq, peers)
        finally:
            self.stats.match_seconds += time.thread_time() - start
            self.stats.match_calls += 1

    def _match(self, seq: SchedulerSequence, peers: list[SchedulerSequence]) -> PrefixMatch:
        """The deepest reusable prefix of `seq`. At least one token is left to compute, except for a hybrid prompt
        whose prompt-end checkpoint kept its logits (an identical prompt then needs no forward at all).

        `peers` are sequences in flight (not yet in the trie): a prefix shared with one of them is a branch point
        too, so that concurrent requests with a common prefix leave a checkpoint for the ones that follow.

        Cost: no hashing, lookup or comparison block by block. A hybrid hit is found by the index prefilter (prefix
        hashes of all live checkpoints compared at once) and one exact comparison of the checkpoint's frozen tokens;
        its block path is the checkpoint's recorded one. The cached run of blocks past it is found by binary search
        on block prefix keys and verified in one comparison; branch points and miss reasons look only past that
        run. What was verified is memoized on the request."""
        tokens = seq.token_array()
        n, bs = len(tokens), self.block_size
        ck, mm_limited, routes_limited = None, 0, 0
        if self.is_hybrid:
            ck, mm_limited, routes_limited = self._find_checkpoint(seq, tokens, n if self.prompt_logits else n - 1)
        path = self._cached_path(seq, tokens, list(ck.nodes) if ck is not None else [])
        if self.is_hybrid:
            hit = ck.step if ck is not None else 0
        else:
            depth = min(len(path), (n - 1) // bs)
            while depth and not seq.is_prefix_cache_boundary_safe(depth * bs):
                depth -= 1
                mm_limited = min(len(path), (n - 1) // bs) * bs
            if seq.routed_experts is not None and route_store.routed_depth(path, depth) < depth:
                routes_limited, depth = depth * bs, route_store.routed_depth(path, depth)
            hit = depth * bs
        covered, evicted_until = self.coverage.cached(seq, tokens, path)
        junction = 0
        if self.branch_checkpoints and self.is_hybrid:
            peers_covered = self.coverage.in_flight(seq, tokens, path, peers, hit)
            junction = self.coverage.junction(seq, max(covered, peers_covered), hit)
        miss = self.coverage.attribute(seq, tokens, path, hit, covered, evicted_until, mm_limited, routes_limited)
        return PrefixMatch(hit, path[:hit // bs], ck, junction, miss)

    def _find_checkpoint(self, seq: SchedulerSequence, tokens: np.ndarray, max_step: int
                         ) -> tuple[NodeStateCheckpoint | None, int, int]:
        """The deepest verified, usable checkpoint, and the deepest verified steps rejected for a multimodal span
        and (for a sequence that records routed experts) for routes the cache cannot replay."""
        n, mm_limited, routes_limited = len(tokens), 0, 0
        memo = self.hasher.memo(seq)
        for ck in self.checkpoint_candidates(seq, max_step):
            step = ck.step
            if step == n and ck.last_logits is None:
                continue
            # A hash never proves a hit: verify the frozen data exactly (once per request; candidates are published).
            if ck is not memo.checkpoint:
                if not self._same_prefix(seq, tokens, ck):
                    continue
                memo.checkpoint = ck
            if not seq.is_prefix_cache_boundary_safe(step):
                mm_limited = max(mm_limited, step)
                continue
            if seq.routed_experts is not None and not route_store.has_routes(ck.nodes, ck, step, self.block_size):
                routes_limited = max(routes_limited, step)
                continue
            return ck, mm_limited, routes_limited
        return None, mm_limited, routes_limited

    @staticmethod
    def _same_prefix(seq: SchedulerSequence, tokens: np.ndarray, ck: NodeStateCheckpoint) -> bool:
        """The checkpoint's frozen token ids and multimodal identity equal the sequence's over [0, step). Then the
        sequence's own trie walk would reach exactly the checkpoint's recorded path, which is attached while the
        checkpoint is published (only leaves are detached, and only after their checkpoints are released;
        `check_integrity` asserts it)."""
        return (ck.prefix_mm_identity == mm_identity_of(seq, 0, ck.step) and ck.anchor.attached
                and ck.position_offset == seq.position_offset(ck.step) and equal_tokens(ck.token_ids, tokens[:ck.step]))

    def checkpoint_candidates(self, seq: SchedulerSequence, max_step: int) -> list[NodeStateCheckpoint]:
        """Published checkpoints whose prefix hashes equal the sequence's at their anchor and step (unverified),
        deepest first."""
        return self.index.candidates(seq.adapter_name, self.hasher.chunk_hashes(seq),
                                     lambda chunks, rems: self.hasher.tail_hashes(seq, chunks, rems), max_step=max_step)

    def _cached_path(self, seq: SchedulerSequence, tokens: np.ndarray, known: list[Node]) -> list[Node]:
        """Trie nodes of the longest cached run of the sequence's leading full blocks, given a verified start
        `known` (or the longer run verified by an earlier match of this request, still attached): binary search for
        the deepest node indexed under the prompt's block prefix key (nodes only leave as leaves, so cached depths
        form a prefix), one exact verification of the blocks past the start, then the exact chained walk from there
        (normally a single failed lookup; it also covers a node the key index missed)."""
        memo = self.hasher.memo(seq)
        while memo.nodes and not memo.nodes[-1].attached:
            memo.nodes.pop()
        bs, path = self.block_size, list(memo.nodes if len(memo.nodes) > len(known) else known)
        max_depth = len(tokens) // bs
        if max_depth > len(path):
            keys = self.hasher.block_keys(seq)
            found, lo, hi = None, len(path) + 1, max_depth
            while lo <= hi:
                mid = (lo + hi) // 2
                node = self.kv.lookup(int(keys[mid]))
                if node is None or node.depth != mid:
                    hi = mid - 1
                else:
                    found, lo = node, mid + 1
            if found is not None:
                path += self.verified_run(seq, tokens, path, found)
        parent = path[-1] if path else self.kv.root(seq.adapter_name)
        for i in range(len(path), max_depth):
            parent = self.kv.find_child(parent, tokens[i * bs:(i + 1) * bs], mm_identity_of(seq, i * bs, (i + 1) * bs))
            if parent is None:
                break
            path.append(parent)
        memo.nodes = path
        return path

    def verified_run(self, seq: SchedulerSequence, tokens: np.ndarray, path: list[Node], node: Node,
                      top: Node | None = None) -> list[Node]:
        """The nodes from just below the end of `path` (or below `top`, a root) down to `node` if they hold exactly
        the sequence's blocks there (tokens and multimodal identity), else []."""
        top = top or (path[-1] if path else self.kv.root(seq.adapter_name))
        run, parts = [], []
        while node.depth > top.depth:
            run.append(node)
            parts.append(node.token_bytes)
            node = node.parent
        if node is not top:
            return []
        run.reverse()
        parts.reverse()
        bs, first, end = self.block_size, top.depth, run[-1].depth
        per = max(1, _VERIFY_BYTES // (8 * bs))
        for i in range(0, len(run), per):
            lo = (first + i) * bs
            part = b''.join(parts[i:i + per])
            if part != tokens[lo:lo + len(part) // 8].tobytes():
                return []
        # Blocks overlapping the sequence's spans must carry its identity, and no other block any.
        num_mm = run[-1].num_mm_blocks - top.num_mm_blocks
        if num_mm or seq.mm_spans:
            blocks = set()
            for span in seq.mm_spans:
                blocks.update(range(max(span.start // bs, first), min(-(-span.end // bs), end)))
            if len(blocks) != num_mm or any(run[i - first].mm_identity != mm_identity_of(seq, i * bs, (i + 1) * bs)
                                            for i in blocks):
                return []
        return run

    def _tail_start(self, step: int) -> int:
        rem = step % self.block_size
        return step - rem if rem else step - self.block_size

    # ---- admission bookkeeping (the contract's admission calls) ------------------------------------------------
    def waits_for_peer(self, seq: SchedulerSequence, match: PrefixMatch, out: SchedulerOutput) -> bool:
        return self.policy.waits_for_peer(seq, match, out)

    def admission_chunk(self, seq: SchedulerSequence, match: PrefixMatch, n: int) -> int:
        return self.policy.admission_chunk(seq, match, n)

    def chunk(self, seq: SchedulerSequence, n: int) -> int:
        return cap_at_hint(seq, n)

    def acquire(self, seq: SchedulerSequence, match: PrefixMatch) -> list[int]:
        if match.checkpoint is not None:
            self.checkpoints.pin(match.checkpoint, self.tick())
        shared = [node.block_id for node in match.nodes]
        self.block_manager.add_ref(shared)
        return shared

    def rollback(self, seq: SchedulerSequence, match: PrefixMatch) -> None:
        self.block_manager.free([node.block_id for node in match.nodes])
        if match.checkpoint is not None:
            self.checkpoints.unpin(match.checkpoint)
        seq.checkpoint_hint = None

    def record_admission(self, seq: SchedulerSequence, match: PrefixMatch, first_admission: bool,
                         out: SchedulerOutput) -> None:
        self.on_admitted(seq, match, first_admission)
        ck = match.checkpoint
        if ck is not None:
            out.pinned.append(ck)
            out.state_restores.append((ck.slot, seq.state_slot))
            if ck.frozen_block_id is not None:
                out.kv_restores.append((ck.frozen_block_id, seq.block_ids[ck.step // self.block_size]))
        if match.num_tokens == seq.num_tokens:
            out.logits_hits.append(LogitsHit(seq, ck.last_logits))

    def on_admitted(self, seq: SchedulerSequence, match: PrefixMatch, first_admission: bool) -> None:
        now = self.tick()
        route_store.replay(seq, match.nodes, match.checkpoint, match.num_tokens, self.block_size)
        self._paths[seq.seq_id] = list(match.nodes)
        if match.junction:
            self._junctions[seq.seq_id] = match.junction
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

    def path_of(self, seq_id: int) -> list[Node]:
        """The canonical path (trie nodes of its leading full blocks) of an admitted sequence; [] otherwise."""
        return self._paths.get(seq_id, [])

    def on_released(self, seq: SchedulerSequence) -> None:
        self._paths.pop(seq.seq_id, None)
        self._junctions.pop(seq.seq_id, None)

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
        tokens, bs = seq.token_array(), self.block_size
        keys = self.hasher.block_keys(seq)
        parent = path[-1] if path else self.kv.root(seq.adapter_name)
        now = self.tick()
        for i in range(len(path), num_full):
            node = self.kv.attach(parent, seq.block_ids[i], tokens[i * bs:(i + 1) * bs],
                                  mm_identity_of(seq, i * bs, (i + 1) * bs), int(keys[i + 1]), now)
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
            self.held.routes_bytes += route_store.keep_block_routes(node, seq, i, bs)
            self.misses.note_attached_block(node.prefix_key)
            path.append(node)
            parent = node
        self.kv.settle_leaf(parent)  # the new run's last node, the only leaf among them
        return path

    # ---- checkpoints ------------------------------------------------------------------------------------------
    def wants_checkpoint(self, seq: SchedulerSequence, step: int) -> bool:
        if not self.is_hybrid or step <= 0 or not seq.is_prefix_cache_boundary_safe(step):
            return False
        if not self.exact_steps and step % self.block_size:
            return False
        tokens = seq.token_array()[:step]
        start = self._tail_start(step)
        key = (seq.adapter_name, step, tail_hash(tokens[start:step], mm_identity_of(seq, start, step)))
        return not any(equal_tokens(ck.token_ids, tokens) for ck in self.index.lookup(key))

    def reserve_checkpoint(self, seq: SchedulerSequence, step: int, slot: int, frozen_block_id: int | None
                           ) -> NodeStateCheckpoint:
        tokens = seq.token_array()[:step].copy()
        start = self._tail_start(step)
        mm = mm_identity_of(seq, start, step)
        chunk_hash, tail_sum = self.hasher.step_hashes(seq, step)
        ck = NodeStateCheckpoint(
            slot=slot, step=step, frozen_block_id=frozen_block_id, adapter_name=seq.adapter_name, token_ids=tokens,
            mm_identity=mm, tail_hash=tail_hash(tokens[start:step], mm), last_access=self.tick(),
            chunk_hash=chunk_hash, tail_sum=tail_sum, prefix_mm_identity=mm_identity_of(seq, 0, step),
            tail_bytes=tokens[step - step % self.block_size:].tobytes(),
            num_hits=int(self._junctions.get(seq.seq_id) == step), position_offset=seq.position_offset(step))
        return self.checkpoints.reserve(ck)

    def note_skipped_checkpoint(self, seq: SchedulerSequence, step: int) -> None:
        """A wanted checkpoint could not be reserved (no slot or block): remember its anchor for miss reasons."""
        self.misses.note_skipped_checkpoint(int(self.hasher.block_keys(seq)[step // self.block_size]))

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
        self.held.routes_bytes += route_store.keep_checkpoint_routes(ck, seq, self.block_size)
        # Recomputed inside the prompt, an evicted checkpoint at this step would have been this request's hit.
        in_prompt = ck.step < seq.num_prompt_tokens or (self.prompt_logits and ck.step == seq.num_prompt_tokens)
        self.checkpoints.publish(ck, tuple(path[:depth]), anchor, self.tick(), revives=in_prompt)
        self.stats.checkpoints_saved += 1
        self.held.on_published(ck, self.checkpoints.bytes_held(ck))

    def keep_logits(self, ck: NodeStateCheckpoint, logits) -> None:
        """Keep a published prompt-end checkpoint's last-position logits (identical prompts sample from them)."""
        before = self.checkpoints.bytes_held(ck)
        ck.last_logits = logits
        self.held.checkpoint_bytes += self.checkpoints.bytes_held(ck) - before

    def _on_evict(self, ck: NodeStateCheckpoint) -> None:
        self.misses.note_evicted_checkpoint(ck.anchor.prefix_key)
        self.held.on_evicted(ck, self.checkpoints.bytes_held(ck), route_store.tail_bytes(ck))

    def mark(self) -> None:
        self.held.mark()

    def routes_bytes(self) -> int:
        """Host bytes of the routed experts kept by blocks and checkpoint tails (a running count, O(1))."""
        return self.held.routes_bytes

    def drop_block_routes(self, node: Node) -> None:
        """Forget the routes `node` keeps: a recording request no longer takes a hit through it (`routes_missing`)."""
        self.held.routes_bytes -= route_store.drop_block_routes(node)

    def plan_checkpoints(self, out: SchedulerOutput) -> None:
        self.policy.plan(out)

    def commit(self, out: SchedulerOutput, prompt_logits: PromptLogits | None = None) -> None:
        for seq in out.seqs:
            if not seq.is_finished:
                self.attach(seq)
        self.publish(out)
        for ck in out.pinned:
            self.checkpoints.unpin(ck)
        self.policy.keep_prompt_logits(out, prompt_logits)

    def plan_replies(self, seqs: list[SchedulerSequence], plan: CopyPlan) -> None:
        self.policy.plan_replies(seqs, plan)

    def plan_verified(self, seq: SchedulerSequence, first: int, last: int, slot_of, plan: CopyPlan) -> None:
        self.policy.plan_verified(seq, first, last, slot_of, plan)

    def publish(self, plan: CopyPlan) -> None:
        for seq, ck in plan.reserved:
            self.publish_checkpoint(seq, ck)

    def discard(self, plan: CopyPlan) -> None:
        for _, ck in plan.reserved:
            self.checkpoints.release(ck)
        for ck in plan.pinned:
            self.checkpoints.unpin(ck)

    # ---- eviction ---------------------------------------------------------------------------------------------
    def allocate_slot(self) -> int | None:
        return self.policy.allocate_slot()

    def evict_blocks(self, num_needed: int) -> bool:
        """Free KV blocks until `num_needed` are free (eviction.py: one order for partial checkpoints and leaves)."""
        return self.eviction.evict_blocks(num_needed)

    def evict_slot(self) -> bool:
        """Free one state slot by evicting the lowest-priority unpinned checkpoint."""
        return self.eviction.evict_slot()

    # ---- invariants -------------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Every published checkpoint's recorded path is attached and is its anchor's path (matching relies on it
        instead of walking the trie), and the running counts of what the cache holds are exact."""
        live = self.checkpoints.live() if self.checkpoints is not None else []
        published = [ck for ck in live if ck.published]
        for ck in published:
            assert self.checkpoints.verify(ck), f'checkpoint at {ck.step} lost its path'
        self.held.check(published, sum(self.checkpoints.bytes_held(ck) for ck in published),
                        route_store.bytes_held(self.kv.roots.values(), live))

    def owners(self) -> tuple[Counter, Counter]:
        blocks = self.kv.owners()
        slots: Counter = Counter()
        if self.checkpoints is not None:
            ck_blocks, slots = self.checkpoints.owners()
            blocks.update(ck_blocks)
        return blocks, slots

    def snapshot(self) -> PrefixCacheSnapshot:
        s, cks = self.stats, self.checkpoints
        return PrefixCacheSnapshot(
            num_requests=s.num_requests, num_hits=s.num_hits, query_tokens=s.query_tokens, hit_tokens=s.hit_tokens,
            logits_hits=s.logits_hits, branch_points=s.branch_points,
            miss_reasons=MappingProxyType(dict(s.miss_reasons)),
            live_checkpoints=self.num_checkpoints, partial_checkpoints=self.held.num_partial,
            live_since_mark=len(self.held.since_mark), partial_since_mark=self.held.partial_since_mark,
            checkpoint_bytes=self.held.checkpoint_bytes, checkpoints_saved=s.checkpoints_saved,
            evicted_checkpoints=cks.num_evicted if cks is not None else 0, evicted_blocks=self.kv.num_evicted,
            evictions_by_cause=MappingProxyType(dict(cks.evictions_by_cause) if cks is not None else {}),
            match_calls=s.match_calls, match_seconds=s.match_seconds)

    @property
    def num_checkpoints(self) -> int:
        return self.checkpoints.num_published if self.checkpoints is not None else 0
