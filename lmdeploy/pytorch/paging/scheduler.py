"""Continuous-batching scheduler.

Owns: the waiting queue and the running list, and every sequence's KV blocks and runtime state slot (through the
BlockManager and StateManager). It decides, per forward, how many tokens each sequence feeds; it never touches
device memory.

Order of operations in one engine step: `schedule()` -> (inputs maker, model agent) -> `on_forward_done()` for
every scheduled sequence -> `finish()` for sequences that stopped.
"""
from __future__ import annotations

from collections import Counter
from typing import NamedTuple

from ..config import CacheConfig, SchedulerConfig
from ..messages import SchedulerSequence, SequenceStatus
from .block_manager import BlockManager
from .state_manager import StateManager


class SchedulerOutput(NamedTuple):
    seqs: list[SchedulerSequence]
    # Tokens each sequence feeds in this forward: token_ids[num_computed : num_computed + n].
    num_new_tokens: list[int]

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, needs_state: bool = False):
        self.config = scheduler_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.block_manager = BlockManager(cache_config.num_blocks, cache_config.pages_per_block)
        self.state_manager = StateManager(cache_config.num_state_slots) if needs_state else None
        self.waiting: list[SchedulerSequence] = []
        self.running: list[SchedulerSequence] = []
        self._arrivals = 0

    # ---- queue management -------------------------------------------------------------------------------------
    def add(self, seq: SchedulerSequence) -> None:
        seq.arrival = self._arrivals
        self._arrivals += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq: SchedulerSequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.finish(seq, SequenceStatus.ABORTED, 'abort')

    def finish(self, seq: SchedulerSequence, status: SequenceStatus, reason: str) -> None:
        """Release everything `seq` owns and mark it finished."""
        if seq in self.running:
            self.running.remove(seq)
        self._release(seq)
        seq.status = status
        seq.finish_reason = reason

    # ---- scheduling -------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this forward's batch.

        Running sequences come first in arrival order (a decode feeds 1 token, a prefill in progress its next
        chunk). When KV runs short, the latest-arrived running sequence is preempted (recomputed later). Then
        waiting sequences are admitted in order while the token budget, the batch size, KV blocks and state
        slots allow; only the first prefill of a batch may be cut into a chunk, so budgets are not frittered
        away on slivers.
        """
        budget = self.config.max_prefill_token_num
        seqs: list[SchedulerSequence] = []
        num_new: list[int] = []
        for seq in list(self.running):
            if seq.status != SequenceStatus.RUNNING or len(seqs) >= self.config.max_batch_size:
                continue
            n = 1 if seq.num_remaining == 1 else min(seq.num_remaining, budget)
            if n == 0 or not self._reserve_blocks(seq, n, scheduled=seqs):
                continue
            seqs.append(seq)
            num_new.append(n)
            budget -= min(n, budget)
        has_prefill = any(n > 1 for n in num_new)
        while self.waiting and budget > 0 and len(seqs) < self.config.max_batch_size:
            seq = self.waiting[0]
            n = seq.num_remaining
            if n > budget:
                if has_prefill:
                    break
                n = budget
            if not self._admit(seq, n):
                break
            self.waiting.pop(0)
            self.running.append(seq)
            seqs.append(seq)
            num_new.append(n)
            budget -= n
            has_prefill = True
        return SchedulerOutput(seqs, num_new)

    def on_forward_done(self, seq: SchedulerSequence, n: int) -> None:
        seq.num_computed += n

    # ---- memory -----------------------------------------------------------------------------------------------
    def _num_blocks_needed(self, seq: SchedulerSequence, n: int) -> int:
        total = -(-(seq.num_computed + n) // self.block_size)
        return max(0, total - len(seq.block_ids))

    def _admit(self, seq: SchedulerSequence, n: int) -> bool:
        """Give a waiting sequence its blocks and state slot; all or nothing."""
        need = self._num_blocks_needed(seq, n)
        if not self.block_manager.can_allocate(need):
            return False
        if self.state_manager is not None:
            slot = self.state_manager.allocate()
            if slot is None:
                return False
            seq.state_slot = slot
        seq.block_ids.extend(self.block_manager.allocate(need))
        seq.status = SequenceStatus.RUNNING
        seq.num_cached = 0
        return True

    def _reserve_blocks(self, seq: SchedulerSequence, n: int, scheduled: list[SchedulerSequence]) -> bool:
        """Make room for `n` more tokens of a running sequence, preempting from the tail of `running`."""
        need = self._num_blocks_needed(seq, n)
        while not self.block_manager.can_allocate(need):
            victims = [s for s in self.running if s is not seq and s not in scheduled]
            if not victims:
                self.preempt(seq)
                return False
            self.preempt(victims[-1])
        seq.block_ids.extend(self.block_manager.allocate(need))
        return True

    def preempt(self, seq: SchedulerSequence) -> None:
        """Drop a running sequence's cache; it will be recomputed from its tokens (prompt + generated so far)."""
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        index = next((i for i, s in enumerate(self.waiting) if s.arrival > seq.arrival), len(self.waiting))
        self.waiting.insert(index, seq)

    def _release(self, seq: SchedulerSequence) -> None:
        if seq.block_ids:
            self.block_manager.free(seq.block_ids)
            seq.block_ids = []
        if seq.state_slot is not None and self.state_manager is not None:
            self.state_manager.free(seq.state_slot)
            seq.state_slot = None

    # ---- invariants -------------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """free + request-owned (+ later trie/checkpoint-owned) = total, for KV blocks and state slots."""
        block_owners: Counter = Counter()
        slot_owners: Counter = Counter()
        for seq in self.running + self.waiting:
            block_owners.update(seq.block_ids)
            if seq.state_slot is not None:
                slot_owners[seq.state_slot] += 1
        self.block_manager.check_integrity(block_owners)
        if self.state_manager is not None:
            self.state_manager.check_integrity(slot_owners)
