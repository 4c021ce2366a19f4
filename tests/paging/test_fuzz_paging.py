"""Property-based fuzzing of the paging layer: Scheduler + BlockManager + StateManager + BlockTrie together.

A hypothesis `RuleBasedStateMachine` drives the scheduler the way the engine does, with no model: admit requests
whose prompts share prefixes at random (non-aligned) boundaries, repeat earlier prompts, carry multimodal spans and
adapters; schedule; run a simulated forward and sample; then the engine's calls `update` -> `commit` -> `release`
(finish on length, with reply checkpoints). Between and inside steps it injects faults: aborts (also of sequences
whose restores / saves are in the current `SchedulerOutput`), failed forwards (`cancel`), preemptions, external
pins, direct evictions, matches.

Abort ordering follows `Engine`: an abort is a command drained at the start of the next step, so an abort that
arrives while a forward is in flight lands after `commit` / `release`; a failed forward runs `cancel`, which also
fails every sequence of its batch.

Content oracle. The machine models what the device would hold: every KV position stores the identity of the prefix
that produced it (a chained hash of adapter, token ids and multimodal markers) and every state slot the identity of
the prefix it summarises. Restores, forward writes and saves move these identities exactly as the copy plans say.
So "every block a forward writes is request-owned", "a checkpoint at `s` holds exactly the state after `[0, s)` and
its frozen block the tail KV", "a hit restores the right state" and "a match is the deepest valid checkpoint" are
checked against data, not against the trie's own bookkeeping.

Pool sizes are tiny (4-16 blocks of 2-4 tokens; 3-7 state rows sized like the engine does), so eviction,
preemption and admission failures are frequent.
"""
from __future__ import annotations

import math
import sys
import time
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lmdeploy import PrefixCacheConfig
from lmdeploy.pytorch.config import CacheConfig, SchedulerConfig
from lmdeploy.pytorch.engine.cache_inputs import CacheCheckpointInputs
from lmdeploy.pytorch.messages import MultiModalSpan, SamplingParams, SchedulerSequence, SequenceStatus
from lmdeploy.pytorch.paging.block_trie import block_trie as block_trie_module
from lmdeploy.pytorch.paging.block_trie import kv_lifecycle as kv_lifecycle_module
from lmdeploy.pytorch.paging.block_trie import node as node_module
from lmdeploy.pytorch.paging.block_trie import prefix_keys as prefix_keys_module
from lmdeploy.pytorch.paging.block_trie.node import CheckpointState, NodeStateCheckpoint
from lmdeploy.pytorch.paging.block_trie.prefix_keys import mm_identity_of
from lmdeploy.pytorch.paging.scheduler import Scheduler, SchedulerOutput
from lmdeploy.pytorch.paging.scheduler_output import ReplyPlan, SampledToken

ALPHABET = 6          # token ids 0..5: random prompts share prefixes often
ADAPTERS = (None, None, None, 'lora')
# A multimodal item's length follows from its content hash, as for a real image.
MM_LENGTH = {1: 1, 2: 2, 3: 3}

# Requests may need up to the whole pool (minus one block) instead of half of it; see Config.max_total_tokens.
FULL_POOL_REQUESTS = True
# Totals over every example of a run, printed at the end of each test (for docs/reliability.md).
FIGURES: Counter = Counter()


# ---- content oracle -----------------------------------------------------------------------------------------------
def root_key(adapter_name: str | None) -> int:
    return hash(('root', adapter_name))


def next_key(prev: int, token: int, marker: int) -> int:
    return hash((prev, token, marker))


def marker_at(spans, pos: int) -> int:
    """Content hash of the multimodal span covering `pos` (0 for text)."""
    return next((h for s, e, h in spans if s <= pos < e), 0)


def _common_prefix(a, b) -> int:
    m = min(len(a), len(b))
    same = a[:m] == b[:m]
    return m if same.all() else int(same.argmin())


class Config:

    def __init__(self, block_size: int, num_blocks: int, hybrid: bool, max_batch_size: int, budget: int,
                 max_prefill: int, exact: bool, decode_interval_blocks: int, policies: tuple[bool, bool, bool, bool]):
        self.block_size, self.num_blocks, self.hybrid = block_size, num_blocks, hybrid
        self.max_batch_size, self.budget, self.max_prefill = max_batch_size, budget, max_prefill
        self.exact, self.decode_interval = exact, decode_interval_blocks * block_size
        # Checkpoint policies: reply checkpoints, prompt logits, branch points, eviction by value.
        self.reply, self.prompt_logits, self.branch, self.value_eviction = policies
        # Sized like memory_sizing.num_state_slots: dummy + one per running sequence + a spare + the checkpoint budget.
        self.num_state_slots = 1 + max_batch_size + 1 + budget if hybrid else 0
        self.session_len = num_blocks * block_size
        # Prompt + generated tokens of one request. Two open scheduler livelocks need a request of more than half
        # the pool (test_hit_needing_the_whole_pool_is_admitted_cold, test_request_is_not_starved_by_duplicate_
        # interior_nodes); set FULL_POOL_REQUESTS once they are fixed.
        self.max_total_tokens = (num_blocks - 1 if FULL_POOL_REQUESTS else (num_blocks - 1) // 2) * block_size

    def __repr__(self) -> str:
        return (f'Config(bs={self.block_size}, blocks={self.num_blocks}, hybrid={self.hybrid}, '
                f'batch={self.max_batch_size}, budget={self.budget}, prefill={self.max_prefill}, exact={self.exact}, '
                f'decode_interval={self.decode_interval}, reply={self.reply}, prompt_logits={self.prompt_logits}, '
                f'branch={self.branch}, value_eviction={self.value_eviction})')


configs = st.builds(
    Config, block_size=st.sampled_from([2, 3, 4]), num_blocks=st.integers(4, 16),
    hybrid=st.sampled_from([True, True, True, False]), max_batch_size=st.integers(1, 3), budget=st.integers(0, 2),
    max_prefill=st.integers(2, 24), exact=st.sampled_from([True, True, True, False]),
    decode_interval_blocks=st.sampled_from([0, 0, 1, 2]),
    policies=st.tuples(st.booleans(), st.booleans(), st.booleans(), st.booleans()))


class PagingMachine(RuleBasedStateMachine):
    """Scheduler + BlockManager + StateManager + BlockTrie under random traffic and faults (see module docstring)."""

    @initialize(cfg=configs)
    def setup(self, cfg: Config) -> None:
        FIGURES['examples'] += 1
        self.cfg, bs = cfg, cfg.block_size
        prefix_cache = PrefixCacheConfig(
            checkpoint_mode='exact' if cfg.exact else 'aligned', decode_state_interval=cfg.decode_interval,
            reply_checkpoints=cfg.reply, prompt_logits=cfg.prompt_logits, branch_checkpoints=cfg.branch,
            value_eviction=cfg.value_eviction, prefill_state_interval=0).resolved(bs)
        cache = CacheConfig(block_size=bs, kernel_block_size=bs, num_blocks=cfg.num_blocks,
                            num_state_slots=cfg.num_state_slots, prefix_cache=prefix_cache, state_row_bytes=64,
                            kv_block_bytes=32)
        config = SchedulerConfig(max_batch_size=cfg.max_batch_size, max_prefill_token_num=cfg.max_prefill,
                                 session_len=cfg.session_len)
        self.s = Scheduler(config, cache, needs_state=cfg.hybrid)
        self.trie = self.s.trie
        self.bs = bs
        self.next_id = 1
        self.seqs: list[SchedulerSequence] = []        # live (waiting or running)
        self.history: list[SchedulerSequence] = []     # every sequence ever added (prompt sources)
        self.in_flight: SchedulerOutput | None = None
        self.deferred_aborts: list[SchedulerSequence] = []
        self.external_pins: list[NodeStateCheckpoint] = []
        self._keys: dict[int, list[int]] = {}
        self._node_keys: dict = {}
        self.ck_expect: dict[NodeStateCheckpoint, tuple[int, list[int]]] = {}
        # Device-side contents: KV positions and state rows hold prefix identities (None = garbage).
        self.kv: dict[int, list[int | None]] = {}
        self.state: dict[int, int | None] = {}
        self._wrap_allocators()
        self._wrap_releases()

    # ---- instrumentation -----------------------------------------------------------------------------------------
    def _wrap_allocators(self) -> None:
        """Freshly allocated blocks and slots hold garbage, so a missing restore or a wrong share is caught."""
        bm, sm, bs = self.s.block_manager, self.s.state_manager, self.bs
        allocate_blocks = bm.allocate

        def allocate(num):
            ids = allocate_blocks(num)
            for block_id in ids:
                self.kv[block_id] = [None] * bs
            return ids

        bm.allocate = allocate
        if sm is not None:
            allocate_slot = sm.allocate

            def allocate_row():
                slot = allocate_slot()
                if slot is not None:
                    self.state[slot] = None
                return slot

            sm.allocate = allocate_row
        preempt = self.s.preempt

        def counted_preempt(seq):
            FIGURES['preemptions'] += 1
            preempt(seq)

        self.s.preempt = counted_preempt

    def _wrap_releases(self) -> None:
        """Invariant 4 and README invariant 6, checked at the moment a checkpoint or a leaf goes."""
        trie = self.trie
        lifecycle = trie.checkpoints
        detach = trie.kv.detach

        def checked_detach(node):
            assert self.s.block_manager.ref_count(node.block_id) == 1, 'evicted a leaf a request still uses'
            FIGURES['evicted_leaves'] += 1
            detach(node)

        trie.kv.detach = checked_detach
        evict_leaf = trie.eviction.evict_leaf

        def checked_evict_leaf(priority, leaf):
            # One order: the leaf is the lowest-priority candidate; partial checkpoints win ties.
            assert priority == trie.kv.leaf_priority(leaf)
            if lifecycle is not None:
                cheaper = [ck for ck in lifecycle.live()
                           if ck.is_partial and lifecycle.is_evictable(ck) and ck.priority <= priority]
                assert not cheaper, 'a trie leaf was evicted before a partial checkpoint of no higher priority'
            evict_leaf(priority, leaf)

        trie.eviction.evict_leaf = checked_evict_leaf
        if lifecycle is None:
            return
        release = lifecycle.release

        def checked_release(ck):
            assert ck.pin_count == 0, 'a pinned checkpoint was released'
            assert all(ck is not p for p in self.external_pins), 'an externally pinned checkpoint was released'
            if ck.published:
                FIGURES['released_checkpoints'] += 1
            release(ck)

        lifecycle.release = checked_release

    # ---- keys ------------------------------------------------------------------------------------------------------
    def keys(self, seq: SchedulerSequence, upto: int) -> list[int]:
        """keys[i] = identity of the prefix [0, i) (keys[0] = the adapter's root)."""
        keys = self._keys.setdefault(seq.seq_id, [root_key(seq.adapter_name)])
        spans = [(sp.start, sp.end, sp.content_hash) for sp in seq.mm_spans]
        for i in range(len(keys) - 1, upto):
            keys.append(next_key(keys[i], seq.token_ids[i], marker_at(spans, i)))
        return keys

    def node_keys(self, node) -> list[int]:
        """Identities of a trie node's positions, from its own tokens and multimodal identity only."""
        if node in self._node_keys:
            return self._node_keys[node]
        prev = root_key(node.adapter_name) if node.parent.is_root else self.node_keys(node.parent)[-1]
        out = []
        for j, token in enumerate(node.token_ids.tolist()):
            prev = next_key(prev, token, marker_at(node.mm_identity, j))
            out.append(prev)
        self._node_keys[node] = out
        return out

    # ---- request generation ----------------------------------------------------------------------------------------
    def _draw_prompt(self, data) -> tuple[list[int], tuple[MultiModalSpan, ...], str | None]:
        cap = self.cfg.max_total_tokens - 1
        kind = data.draw(st.sampled_from(['fresh', 'derived', 'extend', 'extend', 'identical']))
        sources = self.history
        if kind == 'identical' and sources:
            src = data.draw(st.sampled_from(sources))
            prompt = list(src.token_ids[:src.num_prompt_tokens])[:cap]
            spans = tuple(sp for sp in src.mm_spans if sp.end <= cap)
            return prompt, self._maybe_swap_image(data, spans), src.adapter_name
        if kind in ('derived', 'extend') and sources:
            src = data.draw(st.sampled_from(sources))
            # Cut anywhere in prompt + generated tokens (a branch), or keep them all (a follow-up turn); then append
            # a short suffix.
            cut = min(src.num_tokens, cap) if kind == 'extend' else data.draw(st.integers(0, min(src.num_tokens, cap)))
            suffix = data.draw(st.lists(st.integers(0, ALPHABET - 1), min_size=0 if cut else 1, max_size=6))
            prompt = (list(src.token_ids[:cut]) + suffix)[:cap] or [0]
            spans = self._maybe_swap_image(data, tuple(sp for sp in src.mm_spans if sp.end <= cut))
            return prompt, self._maybe_add_span(data, prompt, spans), src.adapter_name
        length = data.draw(st.integers(1, max(1, min(cap, 20))))
        prompt = data.draw(st.lists(st.integers(0, ALPHABET - 1), min_size=length, max_size=length))
        return prompt, self._maybe_add_span(data, prompt, ()), data.draw(st.sampled_from(ADAPTERS))

    def _maybe_swap_image(self, data, spans):
        """The same tokens with another image in the same place: must never match the original's cache."""
        if not spans or not data.draw(st.booleans()):
            return spans
        i = data.draw(st.integers(0, len(spans) - 1))
        other = MultiModalSpan(spans[i].start, spans[i].end, -spans[i].content_hash)
        return spans[:i] + (other,) + spans[i + 1:]

    def _maybe_add_span(self, data, prompt, spans):
        if not data.draw(st.booleans()):
            return spans
        h = data.draw(st.sampled_from(sorted(MM_LENGTH)))
        length = MM_LENGTH[h]
        if len(prompt) < length:
            return spans
        start = data.draw(st.integers(0, len(prompt) - length))
        if any(start < sp.end and sp.start < start + length for sp in spans):
            return spans
        return tuple(sorted(spans + (MultiModalSpan(start, start + length, h),), key=lambda sp: sp.start))

    # ---- rules: traffic --------------------------------------------------------------------------------------------
    @rule(data=st.data())
    def add_request(self, data) -> None:
        prompt, spans, adapter = self._draw_prompt(data)
        room = self.cfg.max_total_tokens - len(prompt)
        max_new = data.draw(st.integers(1, max(1, min(6, room))))
        seq = SchedulerSequence(seq_id=self.next_id, token_ids=prompt, num_prompt_tokens=len(prompt),
                                sampling=SamplingParams(max_new_tokens=max_new), mm_spans=spans,
                                adapter_name=adapter)
        self.next_id += 1
        self.s.add(seq)
        self.seqs.append(seq)
        self.history.append(seq)
        FIGURES['requests'] += 1

    @precondition(lambda self: self.in_flight is None)
    @rule()
    def schedule(self) -> None:
        """Start a step: drain queued aborts (as the engine drains commands), then schedule."""
        self._drain_aborts()
        out = self.s.schedule()
        if out.is_empty:
            assert not out.pinned and not out.reserved and not out.has_copies
            return
        self._check_plans(out)
        self._simulate_forward(out)
        self.in_flight = out

    @precondition(lambda self: self.in_flight is not None)
    @rule()
    def complete_forward(self) -> None:
        """`Engine._run_forward` after the forward: sample (forward rows, then logits hits), then `update` ->
        `commit` (keeping prompt-end logits) -> `release` (finish on length with reply checkpoints)."""
        out, self.in_flight = self.in_flight, None
        FIGURES['forwards'] += 1
        sampled = [seq for seq, n in zip(out.seqs, out.num_new_tokens)
                   if seq.num_computed + n == seq.num_tokens and not seq.is_finished]
        # The "model": the next token is a function of the prefix identity (equal prefixes, equal tokens).
        rows = [SampledToken(seq, self.keys(seq, seq.num_tokens)[-1] % ALPHABET, None)
                for seq in sampled + [seq for seq, _ in out.logits_hits]]
        updates = self.s.update(out, rows)

        def prompt_logits(seq: SchedulerSequence):
            return ('logits', self.keys(seq, seq.num_computed)[seq.num_computed]) if seq in sampled else None
        self._release(self.s.commit(out, updates, prompt_logits if self.cfg.prompt_logits else None))

    @precondition(lambda self: self.in_flight is None)
    @rule()
    def step(self) -> None:
        """A whole engine step at once (more progress per hypothesis step)."""
        self.schedule()
        if self.in_flight is not None:
            self.complete_forward()

    @precondition(lambda self: self.in_flight is None)
    @rule(data=st.data(), num_steps=st.integers(1, 6))
    def add_and_run(self, data, num_steps: int) -> None:
        """Traffic burst: a request arrives, then a few whole steps (keeps queues busy at a low rule count)."""
        self.add_request(data)
        for _ in range(num_steps):
            self.step()
            self._check_all()

    @precondition(lambda self: self.in_flight is not None)
    @rule()
    def fail_forward(self) -> None:
        """The engine's failed-forward path: cancel the plans, then fail every sequence of the batch."""
        out, self.in_flight = self.in_flight, None
        failed = self.s.cancel(out)
        for ck in out.pinned:
            assert ck.published, 'a pinned checkpoint lost its publication'
        assert all(seq.status == SequenceStatus.ABORTED and seq.finish_reason == 'error' for seq in failed)
        for seq in failed:
            self.seqs.remove(seq)
        FIGURES['failed_forwards'] += 1

    # ---- rules: faults ---------------------------------------------------------------------------------------------
    @rule(data=st.data())
    def abort(self, data) -> None:
        """Abort a random live sequence; while a forward is in flight it is queued, like `Engine.abort_request`."""
        if not self.seqs:
            return
        if self.in_flight is not None:
            # Prefer sequences whose restores or saves are in the in-flight output.
            busy = [seq for seq in self.in_flight.seqs
                    if any(dst == seq.state_slot for _, dst in self.in_flight.state_restores)
                    or any(owner is seq for owner, _ in self.in_flight.reserved)]
            pool = busy if busy and data.draw(st.booleans()) else self.seqs
            seq = data.draw(st.sampled_from(pool))
            self.deferred_aborts.append(seq)
            FIGURES['aborts_in_flight'] += 1
            FIGURES['aborts_in_flight_with_pending_copies'] += seq in busy
            return
        seq = data.draw(st.sampled_from(self.seqs))
        self._finish(seq, SequenceStatus.ABORTED, 'abort')
        FIGURES['aborts'] += 1

    @precondition(lambda self: self.in_flight is None)
    @rule(data=st.data())
    def finish_early(self, data) -> None:
        """A stop token or stop sequence: the request finishes between steps (its reply checkpoint copies may
        fail)."""
        running = [seq for seq in self.seqs if seq.status == SequenceStatus.RUNNING]
        if running:
            seq = data.draw(st.sampled_from(running))
            self._release(self.s.stop([(seq, 'stop')]), copies_fail=data.draw(st.integers(0, 3)) == 0)

    @precondition(lambda self: self.in_flight is None)
    @rule(data=st.data())
    def preempt(self, data) -> None:
        running = [seq for seq in self.seqs if seq.status == SequenceStatus.RUNNING]
        if running:
            self.s.preempt(data.draw(st.sampled_from(running)))

    @rule(data=st.data())
    def evict(self, data) -> None:
        """Direct eviction (also while a forward is in flight): `evict_blocks(k)` or `evict_slot()`."""
        bm, sm = self.s.block_manager, self.s.state_manager
        if data.draw(st.booleans()):
            want = data.draw(st.integers(1, bm.num_blocks))
            assert self.trie.evict_blocks(want) == bm.can_allocate(want)
        else:
            before = sm.num_free if sm is not None else 0
            ok = self.trie.evict_slot()
            assert ok == (sm is not None and sm.num_free == before + 1)
        FIGURES['direct_evictions'] += 1

    @rule(data=st.data())
    def pin(self, data) -> None:
        """Somebody (a restore of an in-flight forward) holds a pin across steps."""
        if self.trie.checkpoints is None:
            return
        # live() comes from a set: sort it, or replaying a choice sequence would pick a different checkpoint.
        published = sorted((ck for ck in self.trie.checkpoints.live() if ck.published), key=lambda ck: ck.slot)
        if published:
            ck = data.draw(st.sampled_from(published))
            self.trie.checkpoints.pin(ck, self.trie.tick())
            self.external_pins.append(ck)
            FIGURES['external_pins'] += 1

    @precondition(lambda self: self.external_pins)
    @rule(data=st.data())
    def unpin(self, data) -> None:
        ck = self.external_pins.pop(data.draw(st.integers(0, len(self.external_pins) - 1)))
        self.trie.checkpoints.unpin(ck)

    @rule(data=st.data())
    def match(self, data) -> None:
        """`BlockTrie.match` on a live sequence, a past one, or a new prompt; checked against the oracle."""
        pool = self.seqs + self.history[-8:]
        if pool and data.draw(st.booleans()):
            src = data.draw(st.sampled_from(pool))
            prompt, spans, adapter = list(src.token_ids), src.mm_spans, src.adapter_name
        else:
            prompt, spans, adapter = self._draw_prompt(data)
        query = SchedulerSequence(seq_id=-self.next_id, token_ids=prompt, num_prompt_tokens=len(prompt),
                                  sampling=SamplingParams(), mm_spans=spans, adapter_name=adapter)
        self.next_id += 1
        self._check_match(query)
        self._keys.pop(query.seq_id, None)
        FIGURES['matches'] += 1

    @precondition(lambda self: self.in_flight is None)
    @rule(dice=st.integers(0, 7))
    def drain(self, dice: int) -> None:
        """Liveness (rarely mid-run, always at teardown): with the external pins dropped, every queued request
        finishes in bounded steps; then the whole cache can be evicted and every block and slot is free."""
        if dice == 0:
            self._drain_and_empty()

    # ---- helpers ---------------------------------------------------------------------------------------------------
    def _finish(self, seq: SchedulerSequence, status: SequenceStatus, reason: str) -> None:
        self.s.finish(seq, status, reason)
        self.seqs.remove(seq)

    def _release(self, plan: ReplyPlan, copies_fail: bool = False) -> None:
        """`Engine._run_forward` after `commit`: queue the reply plan's saves (or fail them), then `release`."""
        assert not (plan.pinned or plan.kv_restores or plan.state_restores)
        if not self.cfg.reply or not self.cfg.hybrid:
            assert not plan.has_copies
        copied = True
        if plan.has_copies:
            self._check_saves(plan)
            if copies_fail:
                copied = False
                FIGURES['failed_reply_copies'] += 1
            else:
                self._simulate_saves(plan)
                FIGURES['reply_checkpoints'] += len(plan.reserved)
        self.s.release(plan, copied=copied)
        for seq, _ in plan.finishing:
            assert seq.status == SequenceStatus.FINISHED
            self.seqs.remove(seq)

    def _drain_aborts(self) -> None:
        aborts, self.deferred_aborts = self.deferred_aborts, []
        for seq in aborts:
            if not seq.is_finished:
                self._finish(seq, SequenceStatus.ABORTED, 'abort')

    def _drain_and_empty(self) -> None:
        while self.external_pins:
            self.trie.checkpoints.unpin(self.external_pins.pop())
        if self.in_flight is not None:
            self.complete_forward()
        self._drain_aborts()
        # Each request needs at most max_total_tokens forwards alone; a generous bound catches livelocks.
        budget = 4 * sum(self.cfg.max_total_tokens for _ in self.seqs) + 16
        for _ in range(budget):
            if not self.s.has_unfinished:
                break
            self.step()
            self._check_all()
        assert not self.s.has_unfinished, f'livelock: {len(self.s.waiting)} waiting, {len(self.s.running)} running'
        bm, sm = self.s.block_manager, self.s.state_manager
        assert self.trie.evict_blocks(bm.num_blocks), 'an idle cache could not be evicted completely'
        while self.trie.evict_slot():
            pass
        assert bm.num_free == bm.num_blocks and self.trie.kv.num_nodes == 0
        assert sm is None or sm.num_free == sm.num_usable
        self.s.check_integrity()
        FIGURES['drains'] += 1

    def _check_plans(self, out: SchedulerOutput) -> None:
        """Invariant 6 (validated offsets, unique destinations disjoint from sources), 1 and 9."""
        bm, trie = self.s.block_manager, self.trie
        CacheCheckpointInputs.build(out.kv_restores, out.state_restores, out.kv_saves, out.state_saves,
                                    bm.resolve_gpu_block_offsets)
        assert len(out.seqs) <= self.cfg.max_batch_size
        # The prefill budget holds, except where a piece is one whole image longer than the budget left (a chunk
        # never splits an image: it stops before one, or, starting at one, takes it whole).
        whole_image = any(n > 1 and any(sp.start == seq.num_computed and sp.end == seq.num_computed + n
                                        for sp in seq.mm_spans) for seq, n in zip(out.seqs, out.num_new_tokens))
        assert whole_image or sum(n for n in out.num_new_tokens if n > 1) <= self.cfg.max_prefill
        for seq, n in zip(out.seqs, out.num_new_tokens):
            assert seq.is_prefix_cache_boundary_safe(seq.num_computed + n), 'a chunk ends inside an image'
        node_blocks = set(trie.kv.owners())
        frozen = {ck.frozen_block_id for ck in trie.checkpoints.live()} if trie.checkpoints is not None else set()
        for seq, n in zip(out.seqs, out.num_new_tokens):
            assert seq.status == SequenceStatus.RUNNING and 1 <= n <= seq.num_remaining
            need = math.ceil((seq.num_computed + n) / self.bs)
            assert len(seq.block_ids) >= need
            written = {seq.block_ids[p // self.bs] for p in range(seq.num_computed, seq.num_computed + n)}
            assert not written & node_blocks, f'a forward writes trie-owned blocks {written & node_blocks}'
            assert not written & frozen, f'a forward writes frozen checkpoint blocks {written & frozen}'
            assert all(bm.ref_count(b) == 1 for b in written), 'a forward writes a shared block'
        slots = {seq.state_slot: seq for seq in out.seqs + [seq for seq, _ in out.logits_hits]}
        for ck in out.pinned:
            assert ck.published and ck.pin_count >= 1
        for src, dst in out.kv_restores:
            assert bm.ref_count(dst) == 1 and dst not in node_blocks and src in frozen
        for src, dst in out.state_restores:
            assert dst in slots and any(ck.slot == src for ck in out.pinned)
        for seq, logits in out.logits_hits:
            # An identical prompt: no tokens to feed, the first token comes from the kept prompt-end logits.
            assert self.cfg.prompt_logits and seq.status == SequenceStatus.RUNNING and seq not in out.seqs
            assert seq.num_computed == seq.num_tokens
            assert seq.num_preemptions or seq.num_cached == seq.num_tokens  # num_cached: the first admission's
            assert logits == ('logits', self.keys(seq, seq.num_tokens)[seq.num_tokens]), 'logits of another prompt'
            FIGURES['logits_hits'] += 1
        self._check_saves(out)
        FIGURES['restores'] += len(out.state_restores) + len(out.kv_restores)
        FIGURES['admitted_with_hit'] += len(out.pinned)

    def _check_saves(self, out: SchedulerOutput) -> None:
        """Reserved checkpoints: safe boundary, mode, their save copies; remember what they must end up holding."""
        cuts = {(cut.seq.seq_id, cut.step, cut.slot) for cut in getattr(out, 'state_cuts', ())}
        for seq, ck in out.reserved:
            assert ck.state == CheckpointState.RESERVED and ck.pin_count == 0
            assert seq.is_prefix_cache_boundary_safe(ck.step), 'a checkpoint inside a multimodal span'
            assert self.cfg.exact or ck.step % self.bs == 0
            if (seq.seq_id, ck.step, ck.slot) in cuts:
                # A state cut inside this forward's piece (aligned fallback of a branch point): no save copy.
                assert not ck.is_partial and seq.num_computed < ck.step
                assert all(dst != ck.slot for _, dst in out.state_saves)
            else:
                assert (seq.state_slot, ck.slot) in out.state_saves
            if ck.is_partial:
                assert (seq.block_ids[ck.step // self.bs], ck.frozen_block_id) in out.kv_saves
            keys = self.keys(seq, ck.step)
            rem = ck.step % self.bs
            self.ck_expect[ck] = (keys[ck.step], keys[ck.step - rem + 1:ck.step + 1])
            FIGURES['checkpoints_reserved'] += 1

    def _check_computed(self, seq: SchedulerSequence) -> None:
        """KV of [0, num_computed) and the state after num_computed tokens are exactly the sequence's."""
        keys = self.keys(seq, seq.num_computed)
        for p in range(seq.num_computed):
            got = self.kv[seq.block_ids[p // self.bs]][p % self.bs]
            assert got == keys[p + 1], f'seq {seq.seq_id}: KV at position {p} is not its own'

    def _simulate_forward(self, out: SchedulerOutput) -> None:
        """restore copies -> forward -> save copies, on the content model (engine order, invariant 5)."""
        for src, dst in out.kv_restores:
            self.kv[dst] = list(self.kv[src])
        for src, dst in out.state_restores:
            self.state[dst] = self.state[src]
        for seq, n in zip(out.seqs, out.num_new_tokens):
            start = seq.num_computed
            self._check_computed(seq)
            keys = self.keys(seq, start + n)
            if self.cfg.hybrid:
                if start:
                    assert self.state[seq.state_slot] == keys[start], f'seq {seq.seq_id}: wrong state at {start}'
                self.state[seq.state_slot] = keys[start + n]
            for p in range(start, start + n):
                self.kv[seq.block_ids[p // self.bs]][p % self.bs] = keys[p + 1]
        for cut in out.state_cuts:  # the forward leaves the state at each cut in its row
            assert cut.seq.num_computed < cut.step < cut.seq.num_computed + out.num_new_tokens[out.seqs.index(cut.seq)]
            self.state[cut.slot] = self.keys(cut.seq, cut.step)[cut.step]
        for seq, _ in out.logits_hits:
            self._check_computed(seq)
            assert self.state[seq.state_slot] == self.keys(seq, seq.num_tokens)[seq.num_tokens]
        self._simulate_saves(out)

    def _simulate_saves(self, out: SchedulerOutput) -> None:
        for src, dst in out.kv_saves:
            self.kv[dst] = list(self.kv[src])
        for src, dst in out.state_saves:
            self.state[dst] = self.state[src]

    def _valid_for(self, ck: NodeStateCheckpoint, query: SchedulerSequence, keys: list[int]) -> bool:
        """Oracle: may `query` resume from `ck`? (Same prefix identity, a safe boundary, one token left.)"""
        usable = ck.step <= query.num_tokens - 1 or (ck.step == query.num_tokens and ck.last_logits is not None)
        return (ck.adapter_name == query.adapter_name and usable and query.is_prefix_cache_boundary_safe(ck.step)
                and self.ck_expect[ck][0] == keys[ck.step])

    def _check_match(self, query: SchedulerSequence) -> None:
        m = self.trie.match(query, peers=self.s.running)
        self._check_match_against_walks(query, m)
        keys = self.keys(query, query.num_tokens)
        n = query.num_tokens
        if m.num_tokens == n:
            assert m.checkpoint is not None and m.checkpoint.last_logits is not None, 'a whole prompt without logits'
            FIGURES['match_logits_hits'] += 1
        else:
            assert 0 <= m.num_tokens <= n - 1, 'a match must leave one token to compute'
        assert query.is_prefix_cache_boundary_safe(m.num_tokens)
        if m.junction:
            assert self.cfg.branch and m.num_tokens < m.junction < n and query.is_prefix_cache_boundary_safe(m.junction)
        if m.miss is not None:
            assert sum(m.miss.values()) == n - m.num_tokens, f'miss reasons {dict(m.miss)} do not cover the misses'
        assert len(m.nodes) == m.num_tokens // self.bs
        for depth, node in enumerate(m.nodes):
            assert node.attached and node.depth == depth + 1
            assert self.node_keys(node) == keys[depth * self.bs + 1:(depth + 1) * self.bs + 1], 'wrong shared block'
        if not self.cfg.hybrid:
            assert m.checkpoint is None and m.num_tokens % self.bs == 0
            return
        live = [ck for ck in self.trie.checkpoints.live() if ck.published]
        deepest = max((ck.step for ck in live if self._valid_for(ck, query, keys)), default=0)
        if m.checkpoint is None:
            assert m.num_tokens == 0 and deepest == 0, f'missed a valid checkpoint at {deepest}'
            return
        ck = m.checkpoint
        FIGURES['match_hits'] += 1
        assert ck.published and self.trie.checkpoints.verify(ck) and ck.step == m.num_tokens
        assert self._valid_for(ck, query, keys), 'matched a checkpoint of a different prefix'
        assert ck.step == deepest, f'matched {ck.step}, the deepest valid checkpoint is {deepest}'
        assert ck.block_ids == tuple(n.block_id for n in m.nodes)

    def _check_match_against_walks(self, query: SchedulerSequence, m) -> None:
        """The vectorised search (block prefix keys, checkpoint paths, sorted continuations, peer prefix hashes)
        finds exactly what the plain block-by-block walk and brute-force comparisons find."""
        trie, bs, n = self.trie, self.bs, query.num_tokens
        tokens = np.asarray(query.token_ids, dtype=np.int64)
        node, path = trie.kv.root(query.adapter_name), []
        for i in range(n // bs):
            node = trie.kv.find_child(node, tokens[i * bs:(i + 1) * bs], mm_identity_of(query, i * bs, (i + 1) * bs))
            if node is None:
                break
            path.append(node)
        assert trie._cached_path(query, query.token_array(), []) == path, 'a memoized run differs from the walk'
        query.prefix_memo = None
        assert trie._cached_path(query, query.token_array(), []) == path, 'the key search missed the cached run'
        assert list(m.nodes) == path[:m.num_tokens // bs]
        if not self.cfg.hybrid:
            depth = min(len(path), (n - 1) // bs)
            while depth and not query.is_prefix_cache_boundary_safe(depth * bs):
                depth -= 1
            assert m.num_tokens == depth * bs, 'a dense match shorter than the cached run'
            return
        if not self.cfg.branch:
            return
        parent, base = (path[-1] if path else trie.kv.root(query.adapter_name)), len(path) * bs
        tails = [c.token_ids for c in parent.children.values()]
        tails += [ck.token_ids[base:] for ck in parent.checkpoints.values()]
        covered = base + max((_common_prefix(tokens[base:base + bs], t) for t in tails), default=0)
        lcps = []   # peers: the common prefix serving the most tokens (length x peers reaching it), deeper on a tie
        for peer in self.s.running:
            if peer is not query and peer.adapter_name == query.adapter_name:
                common = _common_prefix(tokens, np.asarray(peer.token_ids, dtype=np.int64))
                whole = common == n and (self.cfg.prompt_logits or peer.num_tokens > common)
                if common >= min(bs, n) and common > m.num_tokens and not whole:
                    lcps.append(common)
        lcps.sort(reverse=True)
        covered = max(covered, max(((c * (i + 1), c) for i, c in enumerate(lcps)), default=(0, 0))[1])
        junction = min(covered, n - 1)
        if not self.cfg.exact:
            junction -= junction % bs
        while junction > m.num_tokens and not query.is_prefix_cache_boundary_safe(junction):
            junction -= 1
        assert m.junction == (junction if junction > m.num_tokens else 0), 'a branch point off the brute force one'

    # ---- invariants after every rule -------------------------------------------------------------------------------
    @invariant()
    def invariants_hold(self) -> None:
        FIGURES['rule_steps'] += 1
        self._check_all()

    def _check_all(self) -> None:
        s, trie, bm, sm = self.s, self.trie, self.s.block_manager, self.s.state_manager
        s.check_integrity()
        block_owners, slot_owners = Counter(), Counter()
        for seq in s.running + s.waiting:
            block_owners.update(seq.block_ids)
            if seq.state_slot is not None:
                slot_owners[seq.state_slot] += 1
        trie_blocks, ck_slots = trie.owners()
        block_owners.update(trie_blocks)
        slot_owners.update(ck_slots)
        assert bm.num_free + len(block_owners) == bm.num_blocks, 'a KV block is lost'
        if sm is not None:
            assert sm.num_free + len(slot_owners) == sm.num_usable, 'a state slot is lost'
            assert max(slot_owners.values(), default=1) == 1, 'a state slot is owned twice'
        for seq in s.waiting:
            assert seq.status == SequenceStatus.WAITING and not seq.block_ids and seq.state_slot is None
        for seq in s.running:
            assert seq.status == SequenceStatus.RUNNING
            assert len(seq.block_ids) >= math.ceil(seq.num_computed / self.bs)
            assert (seq.state_slot is not None) == self.cfg.hybrid
            self._check_computed(seq)
            if self.cfg.hybrid and seq.num_computed and self.in_flight is None:
                assert self.state[seq.state_slot] == self.keys(seq, seq.num_computed)[seq.num_computed]
        self._check_trie()

    def _check_trie(self) -> None:
        trie = self.trie
        reachable, stack = set(), list(trie.kv.roots.values())
        while stack:
            node = stack.pop()
            assert node.attached
            for child in node.children.values():
                assert child.parent is node and child.depth == node.depth + 1
                assert self.kv[child.block_id] == self.node_keys(child), 'a trie block holds foreign KV'
                reachable.add(child)
                stack.append(child)
        assert len(reachable) == trie.kv.num_nodes, 'nodes attached under an evicted parent'
        if trie.checkpoints is None:
            return
        in_flight = self.in_flight.pinned if self.in_flight is not None else []
        for ck in self.external_pins:
            assert ck.published and ck.pin_count >= 1
        for ck in trie.checkpoints.live():
            if not ck.published:
                # Only the in-flight forward's reservations are unpublished.
                assert self.in_flight is not None and any(ck is r for _, r in self.in_flight.reserved)
                continue
            assert trie.checkpoints.verify(ck), 'a published checkpoint no longer verifies'
            assert ck.anchor.is_root or ck.anchor in reachable
            assert ck.anchor.checkpoints.get((ck.step, ck.tail_hash)) is ck
            assert ck.pin_count == sum(p is ck for p in self.external_pins) + sum(p is ck for p in in_flight)
            state_key, tail = self.ck_expect[ck]
            assert self.state[ck.slot] == state_key, f'checkpoint at {ck.step} holds the wrong state'
            if ck.is_partial:
                assert self.kv[ck.frozen_block_id][:len(tail)] == tail, f'frozen block of {ck.step} is wrong'

    def teardown(self) -> None:
        # Runs in hypothesis' `finally`: after a failed rule, leave the original error alone.
        if getattr(self, 's', None) is not None and sys.exc_info()[0] is None:
            self._drain_and_empty()


def _run(max_examples: int, steps: int) -> None:
    FIGURES.clear()
    start = time.perf_counter()
    machine = PagingMachine.TestCase
    machine.settings = settings(max_examples=max_examples, stateful_step_count=steps, deadline=None,
                                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                       HealthCheck.filter_too_much])
    machine('runTest').runTest()
    figures = dict(sorted(FIGURES.items()))
    print(f'\npaging fuzz: {max_examples} examples x <= {steps} steps in {time.perf_counter() - start:.1f} s: '
          f'{figures}')
    assert FIGURES['match_hits'] > 0 and FIGURES['preemptions'] > 0 and FIGURES['evicted_leaves'] > 0, \
        'the fuzz never exercised hits / preemption / eviction'


def collide_hashes(monkeypatch) -> None:
    """Block hashes take 4 values and tail hashes 2, and prefix hashes are plain token sums: only exact verification
    (token ids, multimodal identity, block path) tells prefixes apart (design invariant 2)."""
    block_hash, tail_hash = node_module.block_hash, node_module.tail_hash
    for module in (kv_lifecycle_module, block_trie_module):
        if hasattr(module, 'block_hash'):
            monkeypatch.setattr(module, 'block_hash', lambda parent, tokens, mm=(): block_hash(parent, tokens, mm) % 4)
    monkeypatch.setattr(block_trie_module, 'tail_hash', lambda tokens, mm=(): tail_hash(tokens, mm) % 2)
    monkeypatch.setattr(prefix_keys_module, 'draw_multipliers', lambda rng, n: np.ones(n, dtype=np.uint64))


def test_paging_state_machine():
    _run(max_examples=500, steps=60)


def test_paging_state_machine_with_colliding_hashes(monkeypatch):
    collide_hashes(monkeypatch)
    _run(max_examples=200, steps=60)


@pytest.mark.slow
def test_paging_state_machine_long():
    _run(max_examples=3000, steps=80)


@pytest.mark.slow
def test_paging_state_machine_with_colliding_hashes_long(monkeypatch):
    collide_hashes(monkeypatch)
    _run(max_examples=1000, steps=80)


# ---- findings pinned down as deterministic tests ---------------------------------------------------------------
def _scheduler(num_blocks: int, block_size: int = 4, max_batch_size: int = 1, budget: int = 0,
               max_prefill: int = 64, policies: bool = False) -> Scheduler:
    prefix_cache = PrefixCacheConfig(reply_checkpoints=policies, prompt_logits=policies, branch_checkpoints=policies,
                                     value_eviction=policies, prefill_state_interval=0)
    cache = CacheConfig(block_size=block_size, kernel_block_size=block_size, num_blocks=num_blocks,
                        num_state_slots=1 + max_batch_size + 1 + budget, prefix_cache=prefix_cache)
    config = SchedulerConfig(max_batch_size=max_batch_size, max_prefill_token_num=max_prefill,
                             session_len=num_blocks * block_size)
    return Scheduler(config, cache, needs_state=True)


def _run_to_idle(s: Scheduler, max_steps: int = 50) -> None:
    for _ in range(max_steps):
        if not s.has_unfinished:
            return
        out = s.schedule()
        fed = [seq for seq, n in zip(out.seqs, out.num_new_tokens) if seq.num_computed + n == seq.num_tokens]
        rows = [SampledToken(seq, 0, None) for seq in fed + [seq for seq, _ in out.logits_hits]]
        s.release(s.commit(out, s.update(out, rows)))  # max_new_tokens=1: every sampled sequence finishes
        s.check_integrity()


def test_hit_needing_the_whole_pool_is_admitted_cold():
    # 5 blocks of 4 tokens (session_len 20). A 10-token prompt leaves trie nodes for [0, 8) and a partial checkpoint
    # at 10 (frozen block). A 19-token prompt extending it needs all 5 blocks: as a hit it keeps the 2 shared blocks
    # and pins the frozen one, so only 2 of the 3 blocks it needs can be found; it waits forever, and so does every
    # request queued behind it. Evicting the checkpoint and admitting it cold would fit.
    s = _scheduler(num_blocks=5)
    s.add(SchedulerSequence(seq_id=1, token_ids=list(range(10)), num_prompt_tokens=10,
                            sampling=SamplingParams(max_new_tokens=1)))
    _run_to_idle(s)
    assert [ck.step for ck in s.trie.checkpoints.live()] == [10]
    long = SchedulerSequence(seq_id=2, token_ids=list(range(10)) + list(range(100, 109)), num_prompt_tokens=19,
                             sampling=SamplingParams(max_new_tokens=1))
    s.add(long)
    _run_to_idle(s)
    assert long.is_finished, f'still {long.status.name} after 50 steps'


def test_request_is_not_starved_by_duplicate_interior_nodes():
    # Found by the state machine (2-token blocks, 7 blocks, one running request, 2 usable state rows, 3-token
    # prefill chunks). A and B (11 zeros) leave trie nodes for [0, 8). C has the same tokens but an image at [8, 10),
    # so none of the checkpoints matches and C recomputes [0, 8) into private blocks; at attach it deduplicates onto
    # the nodes of [0, 4) while the deeper nodes, evicted meanwhile, are re-created from C's own blocks. The nodes of
    # [0, 4) are now interior nodes over C's blocks: only the trie references them, yet no leaf above them is
    # evictable. C (6 blocks) needs its 6th block, finds none, preempts itself, recomputes and ends in the same
    # state: forever.
    s = _scheduler(num_blocks=7, block_size=2, max_prefill=3)
    for seq_id, spans in ((1, ()), (2, ()), (3, (MultiModalSpan(8, 10, 1),))):
        s.add(SchedulerSequence(seq_id=seq_id, token_ids=[0] * 11, num_prompt_tokens=11,
                                sampling=SamplingParams(max_new_tokens=1), mm_spans=spans))
    _run_to_idle(s, max_steps=60)
    assert not s.has_unfinished, f'{len(s.running)} running, {len(s.waiting)} waiting after 60 steps'
