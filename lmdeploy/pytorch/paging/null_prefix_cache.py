"""`NullPrefixCache`: the prefix-cache contract with caching off.

Nothing is ever cached: every match is empty, nothing is reserved or published, and eviction never frees anything;
state slots come straight from the `StateManager`. Owns nothing.
"""
from __future__ import annotations

from collections import Counter

from ..messages import SchedulerSequence
from .prefix_cache import NO_MATCH, PrefixCache, PrefixCacheSnapshot, PrefixMatch, PromptLogits
from .scheduler_output import CopyPlan, SchedulerOutput
from .state_manager import StateManager


class NullPrefixCache(PrefixCache):

    def __init__(self, state_manager: StateManager | None):
        self.state_manager = state_manager

    def match(self, seq: SchedulerSequence, peers: list[SchedulerSequence] = ()) -> PrefixMatch:
        return NO_MATCH

    def waits_for_peer(self, seq: SchedulerSequence, match: PrefixMatch, out: SchedulerOutput) -> bool:
        return False

    def admission_chunk(self, seq: SchedulerSequence, match: PrefixMatch, n: int) -> int:
        return n

    def chunk(self, seq: SchedulerSequence, n: int) -> int:
        return n

    def acquire(self, seq: SchedulerSequence, match: PrefixMatch) -> list[int]:
        return []

    def rollback(self, seq: SchedulerSequence, match: PrefixMatch) -> None:
        pass

    def record_admission(self, seq: SchedulerSequence, match: PrefixMatch, first_admission: bool,
                         out: SchedulerOutput) -> None:
        pass

    def evict_blocks(self, num_needed: int) -> bool:
        return False

    def allocate_slot(self) -> int | None:
        return self.state_manager.allocate()

    def plan_checkpoints(self, out: SchedulerOutput) -> None:
        pass

    def commit(self, out: SchedulerOutput, prompt_logits: PromptLogits | None = None) -> None:
        pass

    def plan_replies(self, seqs: list[SchedulerSequence], plan: CopyPlan) -> None:
        pass

    def plan_verified(self, seq: SchedulerSequence, first: int, last: int, slot_of, plan: CopyPlan) -> None:
        pass

    def publish(self, plan: CopyPlan) -> None:
        pass

    def discard(self, plan: CopyPlan) -> None:
        pass

    def on_released(self, seq: SchedulerSequence) -> None:
        pass

    def check_integrity(self) -> None:
        pass

    def owners(self) -> tuple[Counter, Counter]:
        return Counter(), Counter()

    def mark(self) -> None:
        pass

    def snapshot(self) -> PrefixCacheSnapshot:
        return PrefixCacheSnapshot()
