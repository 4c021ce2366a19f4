"""Typed records of one engine step, as the scheduler plans it and as it applies the forward's result.

Owns no state: `Scheduler.schedule()` fills a `SchedulerOutput`; the engine reads it (inputs maker: tokens, block
tables, copy plans, state cuts) and hands back `SampledToken`s; `Scheduler.update()` turns them into
`SequenceUpdate`s the engine delivers at once; `Scheduler.commit()` returns a `ReplyPlan` whose save copies the engine
queues before `Scheduler.release()`. Copy plans are pairs of logical ids, (src, dst): KV block ids and state slots.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from ..messages import SchedulerSequence

if TYPE_CHECKING:
    from .block_trie.node import NodeStateCheckpoint

CopyPairs = list[tuple[int, int]]


class ReservedCheckpoint(NamedTuple):
    seq: SchedulerSequence                   # the sequence whose state (and tail KV) the checkpoint saves
    checkpoint: NodeStateCheckpoint          # RESERVED until `commit` / `release` publishes it (or drops it)


class LogitsHit(NamedTuple):
    seq: SchedulerSequence                   # admitted with its whole prompt cached: feeds no token
    logits: Any                              # the logits kept with its prompt-end checkpoint (sampled from)


class StateCut(NamedTuple):
    seq: SchedulerSequence                   # a prefill piece of this forward
    step: int                                # absolute step strictly inside the piece whose state is saved
    slot: int                                # checkpoint state slot the model writes that state into


class SampledToken(NamedTuple):
    seq: SchedulerSequence                   # a sequence that fed its last token (or a logits hit)
    token_id: int                            # the sampled token
    logprobs: dict[int, float] | None        # its top logprobs, when the request asked for them
    # Speculative decoding: the draft tokens accepted before `token_id` (emitted first, in order); () otherwise.
    accepted: tuple[int, ...] = ()
    # ... and their top logprobs, in order, when the request asked for them (else ()).
    accepted_logprobs: tuple[dict[int, float], ...] = ()


class SequenceUpdate(NamedTuple):
    seq: SchedulerSequence
    new_token_ids: list[int]                 # what the client receives (empty when a stop token is swallowed)
    logprobs: list[dict[int, float]] | None  # one entry per new token, when the request asked for logprobs
    finish_reason: str | None                # 'stop' / 'length' once the sequence stops; None: it keeps going


@dataclass
class CopyPlan:
    """Cache copies around a forward, and the checkpoints that own their targets."""
    # KV blocks / state slots copied checkpoint -> request before the forward (restores).
    kv_restores: CopyPairs = field(default_factory=list)
    state_restores: CopyPairs = field(default_factory=list)
    # KV blocks / state slots copied request -> checkpoint after the forward (saves).
    kv_saves: CopyPairs = field(default_factory=list)
    state_saves: CopyPairs = field(default_factory=list)
    # Checkpoints pinned for the restores (one entry per restore; unpinned once the copies are queued or dropped).
    pinned: list[NodeStateCheckpoint] = field(default_factory=list)
    # Checkpoints reserved for the saves (and the state cuts): published once the copies are queued.
    reserved: list[ReservedCheckpoint] = field(default_factory=list)

    @property
    def has_copies(self) -> bool:
        return bool(self.kv_restores or self.state_restores or self.kv_saves or self.state_saves)


@dataclass
class SchedulerOutput(CopyPlan):
    """One forward's batch and the cache work around it."""
    seqs: list[SchedulerSequence] = field(default_factory=list)
    # Tokens each sequence feeds in this forward: token_ids[num_computed : num_computed + n].
    num_new_tokens: list[int] = field(default_factory=list)
    # Whole-prompt hits (identical prompt): no tokens to feed; their first token is sampled from the kept logits,
    # after this step's restore copies.
    logits_hits: list[LogitsHit] = field(default_factory=list)
    # In-prefill checkpoints: the model writes the state at `step` into `slot` during the forward
    # (`ModelInputs.state_cuts`); each one's checkpoint is in `reserved`.
    state_cuts: list[StateCut] = field(default_factory=list)
    # Speculative decoding: draft tokens each sequence feeds after its last token (0: none; empty list: no
    # speculation), the state cuts after each draft position into the sequence's spare rows (`draft_slots`), the
    # trie blocks held until this forward's restore copies are queued (the private copy of an aligned hit's last
    # block, which the draft head's overlap row rewrites), and, filled by `Scheduler.update`, the state-row copies
    # (spare row -> runtime row) that leave each verified sequence with the state after its accepted tokens.
    num_drafts: list[int] = field(default_factory=list)
    draft_cuts: list[StateCut] = field(default_factory=list)
    block_pins: list[int] = field(default_factory=list)
    draft_fixups: CopyPairs = field(default_factory=list)
    # Decode-interval checkpoints at steps a verify piece committed (planned by `update`, saved after the draft
    # head's catch-up, published by `commit`).
    verified: CopyPlan = field(default_factory=CopyPlan)
    # Sequences this call could not schedule because scheduling them raised (a fault, not a lack of room): already
    # out of the queues with nothing allocated; the engine fails each with its error and the step goes on.
    rejected: list[tuple[SchedulerSequence, str]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not self.logits_hits

    def drafts_of(self, row: int) -> int:
        """Draft tokens batch row `row` feeds (0 without speculation)."""
        return self.num_drafts[row] if self.num_drafts else 0


@dataclass
class ReplyPlan(CopyPlan):
    """Sequences that stopped this step and the reply checkpoints saved before their slots are reused."""
    # (sequence, finish reason), in the order they stopped; `release` finishes them.
    finishing: list[tuple[SchedulerSequence, str]] = field(default_factory=list)
