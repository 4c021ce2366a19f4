"""The prefix-cache contract: every call the `Scheduler` makes on a prefix cache, and nothing else.

Implemented by `block_trie.BlockTrie` (prefix caching on) and `null_prefix_cache.NullPrefixCache` (off: nothing is
ever cached, every call is a no-op or a plain allocation), so the scheduler has no "caching off" branches.

Which calls mutate, in what order within one engine step (each bullet runs after the ones above it):

1. `Scheduler.schedule()`, per waiting sequence: `match` (pure, apart from memos on the sequence) ->
   `waits_for_peer` (pure) -> `admission_chunk` (sets the sequence's branch-point hint) -> `acquire` (pins the
   matched checkpoint, adds a reference to each shared block) -> the scheduler allocates blocks and a slot ->
   `record_admission` (LRU touches, statistics, restore pairs and pins into the output), or `rollback` (undoes
   `acquire`) when the allocation failed. Whenever KV blocks or state slots run short, at any point of `schedule`:
   `evict_blocks` / `allocate_slot` (evict cached prefixes and unpinned checkpoints). Last: `plan_checkpoints`
   reserves the save targets of the final batch (prefill and chunk ends, branch points, in-prefill cuts, decode
   interval).
2. The forward runs (restore copies, forward, save copies); the cache is not called.
   With speculative decoding, `Scheduler.update` calls `plan_verified` per verify piece (decode-interval
   checkpoints at the committed steps; their saves run after the draft head's catch-up).
3. `Scheduler.commit()`: `commit` (attach newly computed full blocks, publish the reserved checkpoints, unpin the
   restore pins, keep prompt-end logits) -> `plan_replies` (reserve reply checkpoints of the sequences that stopped).
4. `Scheduler.release()`, once the reply saves are queued (or failed): `publish` (or `discard`) the reply plan ->
   `on_released` per finished sequence. `Scheduler.cancel()` (failed forward) calls `discard` on the forward's plan
   instead of step 3.

`on_released` also runs whenever a sequence leaves the running list (abort, preemption). `check_integrity`,
`owners` and `snapshot` are pure, cost O(1) (`check_integrity` excepted) and run on the engine thread between steps;
the engine publishes `snapshot()` once per step for readers on other threads.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple

from ..messages import SchedulerSequence
from .scheduler_output import CopyPlan, SchedulerOutput

if TYPE_CHECKING:
    from .block_trie.node import Node, NodeStateCheckpoint

# Kept logits of a sequence's last prompt position (None: none for it); called only for prompt-end checkpoints.
PromptLogits = Callable[[SchedulerSequence], Any]


class PrefixMatch(NamedTuple):
    num_tokens: int                          # prompt tokens served from the cache (the resume step)
    nodes: list[Node]                        # shared full blocks [0, num_tokens // block_size)
    checkpoint: NodeStateCheckpoint | None   # state to restore (hybrid models), None for dense models
    # Branch point: the prompt shares this many tokens with cached ones but no checkpoint exists there; the first
    # prefill chunk ends exactly here so that a checkpoint is taken (0: none).
    junction: int = 0
    # Uncached prompt tokens by reason (see block_trie/miss_tracker.py).
    miss: Counter | None = None


NO_MATCH = PrefixMatch(0, [], None)


@dataclass
class PrefixCacheStats:
    """Running counters of one prefix cache (mutated by `record_admission` and `commit` / `publish`)."""
    num_requests: int = 0
    num_hits: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    checkpoints_saved: int = 0
    logits_hits: int = 0
    branch_points: int = 0
    miss_reasons: Counter = field(default_factory=Counter)

    # Calls of `match` and the thread CPU time they took.
    match_calls: int = 0
    match_seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass(frozen=True)
class PrefixCacheSnapshot:
    """The prefix cache's statistics at the end of one step (all zero with caching off). Counters run since start."""
    num_requests: int = 0                    # first admissions (a preempted request is counted once)
    num_hits: int = 0                        # of those, with at least one prompt token served from the cache
    query_tokens: int = 0                    # their prompt tokens
    hit_tokens: int = 0                      # of those, served from the cache
    logits_hits: int = 0                     # whole prompts served from kept logits (no prefill at all)
    branch_points: int = 0                   # admissions whose first chunk ended at a branch point
    # uncached prompt tokens by reason (block_trie/miss_tracker.py)
    miss_reasons: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    live_checkpoints: int = 0                # published state checkpoints now
    partial_checkpoints: int = 0             # of those, with a frozen partial block
    live_since_mark: int = 0                 # of those, published after the last `mark()` (a benchmark's window)
    partial_since_mark: int = 0
    checkpoint_bytes: int = 0                # bytes they hold: state rows, frozen blocks, kept logits
    checkpoints_saved: int = 0               # checkpoints ever published
    evicted_checkpoints: int = 0
    evicted_blocks: int = 0                  # trie leaves evicted
    # 'kv' (partial checkpoints under KV pressure), 'kv_leaf' (with their trie leaf), 'state' -> checkpoints evicted
    evictions_by_cause: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    match_calls: int = 0                     # `match` calls and the thread CPU time they took
    match_seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def as_dict(self) -> dict:
        """The flat statistics of `Engine.stats` (one shape, caching on or off)."""
        return {'query_tokens': self.query_tokens, 'hit_tokens': self.hit_tokens, 'hit_rate': self.hit_rate,
                'num_requests': self.num_requests, 'num_hits': self.num_hits,
                'live_checkpoints': self.live_checkpoints, 'evicted_checkpoints': self.evicted_checkpoints,
                'evicted_blocks': self.evicted_blocks, 'checkpoints_saved': self.checkpoints_saved,
                'evictions_by_cause': dict(self.evictions_by_cause), 'logits_hits': self.logits_hits,
                'branch_points': self.branch_points, 'miss_reasons': dict(self.miss_reasons),
                'checkpoint_bytes': self.checkpoint_bytes}


class PrefixCache(ABC):
    """See the module docstring for the order of calls."""

    # ---- admission (inside `schedule`) ------------------------------------------------------------------------
    @abstractmethod
    def match(self, seq: SchedulerSequence, peers: list[SchedulerSequence] = ()) -> PrefixMatch:
        """The deepest reusable prefix of a waiting sequence; `peers` are in flight or queued (branch points)."""

    @abstractmethod
    def waits_for_peer(self, seq: SchedulerSequence, match: PrefixMatch, out: SchedulerOutput) -> bool:
        """True when a prefill piece already in `out` will checkpoint `seq`'s prompt deeper than its hit: `seq`
        then stays queued one step and resumes there."""

    @abstractmethod
    def admission_chunk(self, seq: SchedulerSequence, match: PrefixMatch, n: int) -> int:
        """Set `seq`'s branch-point hint from `match` and cap its first chunk of `n` tokens at it."""

    @abstractmethod
    def chunk(self, seq: SchedulerSequence, n: int) -> int:
        """Cap a running sequence's next piece of `n` tokens at its branch-point hint."""

    @abstractmethod
    def acquire(self, seq: SchedulerSequence, match: PrefixMatch) -> list[int]:
        """Pin the matched checkpoint and add a reference to each shared block; returns the shared block ids."""

    @abstractmethod
    def rollback(self, seq: SchedulerSequence, match: PrefixMatch) -> None:
        """Undo `acquire` (the allocation after it failed) and clear the hint `admission_chunk` set."""

    @abstractmethod
    def record_admission(self, seq: SchedulerSequence, match: PrefixMatch, first_admission: bool,
                         out: SchedulerOutput) -> None:
        """`seq` holds its blocks and slot now: LRU touches, statistics, and the restore copies, pin and logits hit
        of `match` into `out`."""

    # ---- memory -----------------------------------------------------------------------------------------------
    @abstractmethod
    def evict_blocks(self, num_needed: int) -> bool:
        """Evict cached prefixes until `num_needed` KV blocks are free; False when that is impossible."""

    @abstractmethod
    def allocate_slot(self) -> int | None:
        """A free state slot, evicting unpinned checkpoints for it if needed; None when none can be freed."""

    # ---- checkpoints ------------------------------------------------------------------------------------------
    @abstractmethod
    def plan_checkpoints(self, out: SchedulerOutput) -> None:
        """Reserve the checkpoints this forward saves (copies and state cuts into `out`)."""

    @abstractmethod
    def commit(self, out: SchedulerOutput, prompt_logits: PromptLogits | None = None) -> None:
        """The forward and its save copies are queued and its sequences advanced: attach computed full blocks,
        publish `out`'s reserved checkpoints, unpin its restore pins, keep prompt-end logits."""

    @abstractmethod
    def plan_replies(self, seqs: list[SchedulerSequence], plan: CopyPlan) -> None:
        """Reserve reply checkpoints (after every token each sequence consumed) into `plan`."""

    @abstractmethod
    def plan_verified(self, seq: SchedulerSequence, first: int, last: int, slot_of: Callable[[int], int],
                      plan: CopyPlan) -> None:
        """Speculative decoding: a verify piece committed steps (first, last] (`Scheduler.update`, after acceptance).
        Reserve the decode-interval checkpoints among them into `plan`, saving the state at a step from state row
        `slot_of(step)` (a spare row cut at that draft position, or the runtime row): only committed steps."""

    @abstractmethod
    def publish(self, plan: CopyPlan) -> None:
        """`plan`'s save copies are queued: publish its reserved checkpoints."""

    @abstractmethod
    def discard(self, plan: CopyPlan) -> None:
        """`plan`'s copies will not run: release its reserved checkpoints and unpin its pins (if any)."""

    @abstractmethod
    def on_released(self, seq: SchedulerSequence) -> None:
        """`seq` gave its blocks and slot back (finished, aborted, preempted)."""

    # ---- inspection -------------------------------------------------------------------------------------------
    @abstractmethod
    def check_integrity(self) -> None:
        """Assert the cache's internal invariants."""

    @abstractmethod
    def owners(self) -> tuple[Counter, Counter]:
        """(KV block id -> references the cache holds, state slot -> references the cache holds)."""

    @abstractmethod
    def mark(self) -> None:
        """Start the window of `PrefixCacheSnapshot.live_since_mark` (between steps; no-op without checkpoints)."""

    @abstractmethod
    def snapshot(self) -> PrefixCacheSnapshot:
        """The statistics now, as a frozen record (O(1))."""
