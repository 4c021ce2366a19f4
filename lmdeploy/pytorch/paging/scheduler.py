"""Continuous-batching scheduler.

Owns: the waiting queue and the running list, and every sequence's KV blocks and runtime state slot (through the
BlockManager and StateManager); with prefix caching, the `BlockTrie` too. It decides, per forward, how many tokens
each sequence feeds and which cache copies surround the forward; it never touches device memory.

Order of operations in one engine step: `schedule()` -> (inputs maker, model agent: restore copies, forward, save
copies) -> `on_forward_done()` per scheduled sequence -> `after_forward()` (attach blocks, publish checkpoints,
drop restore pins) -> `finish()` for sequences that stopped.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ..config import CacheConfig, SchedulerConfig
from ..messages import SchedulerSequence, SequenceStatus
from .block_manager import BlockManager
from .block_trie.block_trie import BlockTrie, PrefixMatch
from .block_trie.node import NodeStateCheckpoint
from .state_manager import StateManager

CopyPairs = list[tuple[int, int]]
# Queued sequences (the first ones in the queue) whose shared prefix with the one being admitted counts as a branch
# point; bounds the cost of matching against a long queue.
_MAX_QUEUED_PEERS = 16


@dataclass
class SchedulerOutput:
    seqs: list[SchedulerSequence] = field(default_factory=list)
    # Tokens each sequence feeds in this forward: token_ids[num_computed : num_computed + n].
    num_new_tokens: list[int] = field(default_factory=list)
    # Copy plans as (src, dst) logical ids: KV blocks and state slots. Restores run before the forward (checkpoint
    # -> request), saves after it (request -> checkpoint).
    kv_restores: CopyPairs = field(default_factory=list)
    state_restores: CopyPairs = field(default_factory=list)
    kv_saves: CopyPairs = field(default_factory=list)
    state_saves: CopyPairs = field(default_factory=list)
    # Checkpoints pinned for this forward's restores, and checkpoints reserved for its saves.
    pinned: list[NodeStateCheckpoint] = field(default_factory=list)
    reserved: list[tuple[SchedulerSequence, NodeStateCheckpoint]] = field(default_factory=list)
    # Sequences admitted with their whole prompt cached (identical prompt): no tokens to feed; their first token is
    # sampled from the logits kept with the checkpoint (second item), after this step's restore copies.
    logits_hits: list[tuple[SchedulerSequence, object]] = field(default_factory=list)
    # In-prefill checkpoints: (sequence, step inside this forward's piece, checkpoint slot). The model writes the
    # state at `step` into the slot during the forward (`ModelInputs.state_cuts`); the checkpoint is in `reserved`.
    state_cuts: list[tuple[SchedulerSequence, int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not self.logits_hits

    @property
    def has_copies(self) -> bool:
        return bool(self.kv_restores or self.state_restores or self.kv_saves or self.state_saves)


class Scheduler:

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, needs_state: bool = False):
        self.config = scheduler_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.block_manager = BlockManager(cache_config.num_blocks, cache_config.pages_per_block)
        self.state_manager = StateManager(cache_config.num_state_slots) if needs_state else None
        self.trie = BlockTrie(
            self.block_manager, self.state_manager, self.block_size,
            exact_steps=cache_config.prefix_cache_exact_steps,
            prompt_logits=cache_config.prefix_cache_prompt_logits,
            branch_checkpoints=cache_config.prefix_cache_branch_checkpoints,
            value_eviction=cache_config.prefix_cache_value_eviction,
            state_row_bytes=cache_config.state_row_bytes, kv_block_bytes=cache_config.kv_block_bytes,
        ) if cache_config.enable_prefix_caching else None
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
        self.finish(seq, SequenceStatus.ABORTED, 'abort')

    def finish(self, seq: SchedulerSequence, status: SequenceStatus, reason: str) -> None:
        """Release everything `seq` owns and mark it finished."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = status
        seq.finish_reason = reason

    # ---- scheduling -------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this forward's batch.

        Running sequences come first in arrival order (a decode feeds 1 token, a prefill in progress its next
        chunk). When KV runs short, cached prefixes are evicted first, then the latest-arrived running sequence is
        preempted (recomputed later). Then waiting sequences are admitted in order while the token budget, the
        batch size, KV blocks and state slots allow; admission matches the prefix cache first. With branch points
        on, a waiting sequence that a prefill piece already in this batch will checkpoint deeper into its prompt
        than its hit skips this step and keeps its place in the queue. Only the first prefill of a batch may be
        cut into a chunk. Finally prefill and chunk ends reserve state checkpoints.
        """
        out = SchedulerOutput()
        budget = self.config.max_prefill_token_num
        for seq in list(self.running):
            if seq.status != SequenceStatus.RUNNING or len(out.seqs) >= self.config.max_batch_size:
                continue
            n = 1 if seq.num_remaining == 1 else min(seq.num_remaining, budget)
            n = self._cap_at_hint(seq, n)
            if n == 0 or not self._reserve_blocks(seq, n, scheduled=out.seqs):
                continue
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= min(n, budget)
        has_prefill = any(n > 1 for n in out.num_new_tokens)
        index = 0
        while (index < len(self.waiting) and budget > 0
               and len(out.seqs) + len(out.logits_hits) < self.config.max_batch_size):
            seq = self.waiting[index]
            match = self._match(seq)
            if self._waits_for_peer(seq, match, out):
                index += 1  # stays queued (in order) and resumes from the peer's checkpoint next step
                continue
            n = self._admit(seq, match, budget, chunk_ok=not has_prefill, out=out)
            if n is None:
                break
            self.waiting.pop(index)
            self.running.append(seq)
            if n == 0:
                continue  # whole prompt cached: sampled from kept logits (out.logits_hits)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= n
            has_prefill = True
        if self.trie is not None and self.trie.is_hybrid:
            for seq, n in zip(out.seqs, out.num_new_tokens):
                self._plan_checkpoint(seq, n, out)
        return out

    def on_forward_done(self, seq: SchedulerSequence, n: int) -> None:
        seq.num_computed += n

    def after_forward(self, out: SchedulerOutput) -> None:
        """The forward and its save copies are queued: attach blocks, publish checkpoints, drop restore pins."""
        if self.trie is None:
            return
        for seq in out.seqs:
            if not seq.is_finished:
                self.trie.attach(seq)
        self.publish_reserved(out)
        for ck in out.pinned:
            self.trie.checkpoints.unpin(ck)

    def cancel_forward(self, out: SchedulerOutput) -> None:
        """The forward failed: drop its reservations and pins (nothing was published)."""
        if self.trie is None:
            return
        for _, ck in out.reserved:
            self.trie.checkpoints.release(ck)
        for ck in out.pinned:
            self.trie.checkpoints.unpin(ck)

    # ---- admission --------------------------------------------------------------------------------------------
    def _num_blocks_needed(self, seq: SchedulerSequence, n: int) -> int:
        total = -(-(seq.num_computed + n) // self.block_size)
        return max(0, total - len(seq.block_ids))

    def _match(self, seq: SchedulerSequence) -> PrefixMatch:
        """The prefix-cache match of a waiting sequence. Its peers (branch points) are the running sequences and
        the first few queued ones: a prefix it shares with a request still queued is a branch point too, so that
        request can resume there (see `_waits_for_peer`) instead of recomputing it."""
        if self.trie is None:
            return PrefixMatch(0, [], None)
        queued = [s for s in self.waiting[:_MAX_QUEUED_PEERS + 1] if s is not seq][:_MAX_QUEUED_PEERS]
        return self.trie.match(seq, peers=self.running + queued)

    def _waits_for_peer(self, seq: SchedulerSequence, match: PrefixMatch, out: SchedulerOutput) -> bool:
        """Branch policy, in flight: a prefill piece already scheduled in this forward ends on `seq`'s prompt
        deeper than its hit, where a checkpoint will be saved. `seq` then waits one step and resumes there instead
        of recomputing the same tokens beside it (each wait strictly deepens its next hit, so waits are bounded)."""
        if self.trie is None or not self.trie.is_hybrid or not self.trie.branch_checkpoints:
            return False
        n = seq.num_tokens
        for peer, k in zip(out.seqs, out.num_new_tokens):
            end = peer.num_computed + k
            if peer.num_computed >= peer.num_prompt_tokens or end <= match.num_tokens or end > n:
                continue  # a decode step, or a piece ending at or before the hit / past the prompt
            # One token must be left to compute, unless the piece is a whole identical prompt with kept logits.
            usable = end < n or (self.trie.prompt_logits and end == peer.num_tokens)
            if usable and peer.token_ids[:end] == seq.token_ids[:end] and self.trie.wants_checkpoint(peer, end):
                return True
        return False

    def _admit(self, seq: SchedulerSequence, match: PrefixMatch, budget: int, chunk_ok: bool,
               out: SchedulerOutput) -> int | None:
        """Give a waiting sequence its blocks and state slot after matching; all or nothing. Returns the number of
        tokens it feeds in this forward (0: its whole prompt is cached and its first token comes from kept
        logits), or None when it cannot be admitted (nothing changed then). A hit whose pinned checkpoint and
        shared blocks leave too little room is retried cold, so it never blocks the queue."""
        n = self._admit_with(seq, match, budget, chunk_ok, out)
        if n is None and match.num_tokens > 0:
            n = self._admit_with(seq, PrefixMatch(0, [], None, match.junction, match.miss), budget, chunk_ok, out)
        return n

    def _admit_with(self, seq: SchedulerSequence, match: PrefixMatch, budget: int, chunk_ok: bool,
                    out: SchedulerOutput) -> int | None:
        ck = match.checkpoint
        logits_hit = match.num_tokens == seq.num_tokens
        remaining = seq.num_tokens - match.num_tokens
        n = remaining if remaining <= budget else (budget if chunk_ok else 0)
        if not logits_hit:
            seq.checkpoint_hint = match.junction if match.junction > match.num_tokens else None
            n = self._cap_at_hint(seq, n, start=match.num_tokens)
            if n == 0:
                return None
        if ck is not None:
            self.trie.checkpoints.pin(ck, self.trie.tick())
        shared = [node.block_id for node in match.nodes]
        self.block_manager.add_ref(shared)
        total = -(-(match.num_tokens + n) // self.block_size)
        need = total - len(shared)
        slot = None
        ok = self.block_manager.can_allocate(need) or (self.trie is not None and self.trie.evict_blocks(need))
        if ok and self.state_manager is not None:
            slot = self._allocate_slot()
            ok = slot is not None
        if not ok:
            self.block_manager.free(shared)
            if ck is not None:
                self.trie.checkpoints.unpin(ck)
            seq.checkpoint_hint = None
            return None
        seq.block_ids = shared + self.block_manager.allocate(need)
        seq.state_slot = slot
        seq.num_computed = match.num_tokens
        seq.status = SequenceStatus.RUNNING
        first = seq.num_preemptions == 0
        if first:
            seq.num_cached = match.num_tokens
        if self.trie is not None:
            self.trie.on_admitted(seq, match, first_admission=first)
        if ck is not None:
            out.pinned.append(ck)
            out.state_restores.append((ck.slot, slot))
            if ck.frozen_block_id is not None:
                out.kv_restores.append((ck.frozen_block_id, seq.block_ids[ck.step // self.block_size]))
        if logits_hit:
            out.logits_hits.append((seq, ck.last_logits))
        return n

    @staticmethod
    def _cap_at_hint(seq: SchedulerSequence, n: int, start: int | None = None) -> int:
        """End the chunk at the sequence's branch-point hint when the chunk would cross it."""
        start = seq.num_computed if start is None else start
        hint = seq.checkpoint_hint
        if hint is not None and start < hint < start + n:
            return hint - start
        return n

    def _allocate_slot(self) -> int | None:
        slot = self.state_manager.allocate()
        while slot is None and self.trie is not None and self.trie.evict_slot():
            slot = self.state_manager.allocate()
        return slot

    def _plan_checkpoint(self, seq: SchedulerSequence, n: int, out: SchedulerOutput) -> None:
        """Reserve a checkpoint at the end of a prefill piece (prompt end, chunk end, branch point) or at an
        opt-in decode interval, if wanted and affordable. A piece ending at a branch point takes no in-prefill
        cuts: it is the prefix shared with known requests, which its end checkpoint serves, and the per-prompt cap
        is kept for the prompt's own tokens after it, where its later siblings diverge."""
        step = seq.num_computed + n
        at_branch_point = seq.checkpoint_hint == step
        if seq.checkpoint_hint is not None and step >= seq.checkpoint_hint:
            seq.checkpoint_hint = None
        if n > 1 and not at_branch_point:
            self._plan_prefill_cuts(seq, n, out)
        if seq.num_computed >= seq.num_prompt_tokens and n == 1:
            interval = self.cache_config.prefix_cache_decode_state_interval
            if not interval or step % interval:
                return  # a decode step off the opt-in interval
        self._reserve_checkpoint(seq, step, out)

    def _plan_prefill_cuts(self, seq: SchedulerSequence, n: int, out: SchedulerOutput) -> None:
        """In-prefill checkpoints: block-aligned steps strictly inside this piece that are multiples of the interval,
        deepest first, within the per-prompt cap, each in a free state row (never by evicting a checkpoint)."""
        interval = self.cache_config.prefix_cache_prefill_state_interval
        room = self.cache_config.prefix_cache_prefill_state_cap - seq.num_prefill_checkpoints
        if not interval or room <= 0:
            return
        start, end = seq.num_computed, seq.num_computed + n
        step = (end - 1) // interval * interval
        while step > start and room > 0:
            if self.trie.wants_checkpoint(seq, step):
                slot = self.state_manager.allocate()
                if slot is None:
                    return
                ck = self.trie.reserve_checkpoint(seq, step, slot, None)
                out.reserved.append((seq, ck))
                out.state_cuts.append((seq, step, slot))
                seq.num_prefill_checkpoints += 1
                room -= 1
            step -= interval

    def _reserve_checkpoint(self, seq: SchedulerSequence, step: int, out: SchedulerOutput) -> None:
        if not self.trie.wants_checkpoint(seq, step):
            return
        partial = step % self.block_size != 0
        slot = self._allocate_slot()
        if slot is None:
            self.trie.note_skipped_checkpoint(seq, step)
            return
        frozen = None
        if partial:
            if not (self.block_manager.can_allocate(1) or self.trie.evict_blocks(1)):
                self.state_manager.free(slot)
                self.trie.note_skipped_checkpoint(seq, step)
                return
            frozen = self.block_manager.allocate(1)[0]
        ck = self.trie.reserve_checkpoint(seq, step, slot, frozen)
        out.reserved.append((seq, ck))
        out.state_saves.append((seq.state_slot, slot))
        if frozen is not None:
            out.kv_saves.append((seq.block_ids[step // self.block_size], frozen))

    def plan_reply_checkpoints(self, seqs: list[SchedulerSequence]) -> SchedulerOutput:
        """Reserve checkpoints of finishing sequences after every token they consumed (prompt + reply minus the
        last sampled token); the caller queues the save copies, then calls `publish_reserved`, then `finish`."""
        out = SchedulerOutput()
        if self.trie is None or not self.trie.is_hybrid or not self.cache_config.prefix_cache_reply_checkpoints:
            return out
        for seq in seqs:
            if seq.state_slot is not None and seq.num_computed > 0:
                self._reserve_checkpoint(seq, seq.num_computed, out)
        return out

    def publish_reserved(self, out: SchedulerOutput) -> None:
        if self.trie is None:
            return
        for seq, ck in out.reserved:
            self.trie.publish_checkpoint(seq, ck)

    # ---- memory -----------------------------------------------------------------------------------------------
    def _reserve_blocks(self, seq: SchedulerSequence, n: int, scheduled: list[SchedulerSequence]) -> bool:
        """Make room for `n` more tokens of a running sequence: evict cached prefixes, then preempt from the tail
        of `running`."""
        need = self._num_blocks_needed(seq, n)
        while not self.block_manager.can_allocate(need):
            if self.trie is not None and self.trie.evict_blocks(need):
                break
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
        if self.trie is not None:
            self.trie.on_released(seq)
        if seq.block_ids:
            self.block_manager.free(seq.block_ids)
            seq.block_ids = []
        if seq.state_slot is not None and self.state_manager is not None:
            self.state_manager.free(seq.state_slot)
            seq.state_slot = None

    # ---- invariants -------------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """free + request-owned + trie-owned + checkpoint-owned = total, for KV blocks and for state slots."""
        block_owners: Counter = Counter()
        slot_owners: Counter = Counter()
        for seq in self.running + self.waiting:
            block_owners.update(seq.block_ids)
            if seq.state_slot is not None:
                slot_owners[seq.state_slot] += 1
        if self.trie is not None:
            self.trie.check_integrity()
            trie_blocks, ck_slots = self.trie.owners()
            block_owners.update(trie_blocks)
            slot_owners.update(ck_slots)
        self.block_manager.check_integrity(block_owners)
        if self.state_manager is not None:
            self.state_manager.check_integrity(slot_owners)
