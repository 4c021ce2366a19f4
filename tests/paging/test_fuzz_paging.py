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
checked against data, not against the trie's own bookkeeping (fuzz_oracle.py: the configurations, the content
model and the checks; the findings it made are pinned down in test_paging_findings.py).

Pool sizes are tiny (4-16 blocks of 2-4 tokens; 3-7 state rows sized like the engine does), so eviction,
preemption and admission failures are frequent.
"""
from __future__ import annotations

import sys
import time

import numpy as np
import pytest
from fuzz_oracle import ADAPTERS, ALPHABET, FIGURES, MM_LENGTH, Config, PagingChecks, configs
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lmdeploy import PrefixCacheConfig
from lmdeploy.pytorch.config import CacheConfig, SchedulerConfig
from lmdeploy.pytorch.messages import MultiModalSpan, SamplingParams, SchedulerSequence, SequenceStatus
from lmdeploy.pytorch.paging.block_trie import block_trie as block_trie_module
from lmdeploy.pytorch.paging.block_trie import kv_lifecycle as kv_lifecycle_module
from lmdeploy.pytorch.paging.block_trie import node as node_module
from lmdeploy.pytorch.paging.block_trie import prefix_keys as prefix_keys_module
from lmdeploy.pytorch.paging.block_trie.node import NodeStateCheckpoint
from lmdeploy.pytorch.paging.scheduler import Scheduler, SchedulerOutput
from lmdeploy.pytorch.paging.scheduler_output import ReplyPlan, SampledToken


class PagingMachine(PagingChecks, RuleBasedStateMachine):
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

    # ---- invariants after every rule -------------------------------------------------------------------------------
    @invariant()
    def invariants_hold(self) -> None:
        FIGURES['rule_steps'] += 1
        self._check_all()

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
