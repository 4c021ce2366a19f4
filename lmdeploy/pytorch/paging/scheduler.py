"""Continuous-batching scheduler.

Owns: the waiting queue and the running list, and every sequence's KV blocks and runtime state slot (through the
BlockManager and StateManager), and the prefix cache behind its contract (`prefix_cache.py`; a `NullPrefixCache`
with caching off). It decides, per forward, how many tokens each sequence feeds and which cache copies surround the
forward, and it applies the forward's result; it never touches device memory.

One engine step, as the engine drives it (the only order; tests drive the same calls):
`schedule()` -> (inputs maker, model agent: restore copies, forward, save copies, sampling) ->
`update(out, sampled)` (advance computed tokens, append sampled ones, check stops: per-sequence updates the engine
delivers at once) -> `commit(out, updates)` (attach blocks, publish / unpin checkpoints, keep prompt logits; returns
the reply-save plan) -> (the engine queues the plan's copies) -> `release(plan, copied)` (publish or drop the reply
checkpoints, finish the stopped sequences). A failed forward runs `cancel(out)` instead of everything after
`schedule()`.

Speculative decoding (`num_draft_tokens` K > 0; `docs/architecture.md`): every running sequence also holds K spare
state rows (`draft_slots`). A decode with drafts feeds [last token, d_1 .. d_d] (`num_drafts`) with a state cut after
each draft position into a spare row (`draft_cuts`); `update` appends the verified run (1 .. d + 1 tokens, stops
honoured token by token), advances `num_computed` by the tokens it committed and plans the copy of the matching cut
into the runtime row (`draft_fixups`), so the runtime row holds exactly the state after the committed tokens. Blocks
are reserved K - 1 tokens past each piece, for the draft head's chained positions. Checkpoints are never planned for
a verify piece (its end is a draft position); a prefix-cache hit keeps its last aligned block private (a copy), since
the draft head recomputes the position before the hit.

Async scheduling (`engine/async_scheduling.py`) splits `update` in two: `advance(out, sampled)` right after the
forward is launched (computed tokens move on; each sampled sequence gets one pending token, `num_pending`, whose value
is still on the device), then `settle(sampled)` once the tokens reach the host, possibly after the next step was
scheduled and launched. In between, `schedule()` treats a pending token as one more token to feed (a decode), except
that a sequence whose pending token ends it by length is not scheduled. A sequence found stopped by `settle` while
the next forward already fed its token has that piece rolled back (computed tokens, trailing block), which leaves it
exactly as `update` would have. `can_schedule_ahead()` says whether `schedule()` may run with tokens pending: it
must never preempt a sequence with a pending token (its recompute needs the token on the host).
"""
from __future__ import annotations

from collections import Counter

from ..config import CacheConfig, SchedulerConfig
from ..messages import SchedulerSequence, SequenceStatus
from .block_manager import BlockManager
from .prefix_cache import PrefixCache, PrefixMatch, PromptLogits
from .prefix_cache_factory import make_prefix_cache
from .scheduler_output import CopyPairs, ReplyPlan, SampledToken, SchedulerOutput, SequenceUpdate, StateCut
from .sequence_update import append_run, append_sampled
from .state_manager import StateManager

__all__ = ['CopyPairs', 'Scheduler', 'SchedulerOutput']

# Queued sequences (the first ones in the queue) whose shared prefix with the one being admitted counts as a branch
# point; bounds the cost of matching against a long queue.
_MAX_QUEUED_PEERS = 16


class Scheduler:

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, needs_state: bool = False,
                 num_draft_tokens: int = 0):
        self.config = scheduler_config
        self.num_draft_tokens = num_draft_tokens
        # Trie blocks referenced by the forward in flight until its restore copies are queued (`block_pins`).
        self._pinned_blocks: Counter = Counter()
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.block_manager = BlockManager(cache_config.num_blocks, cache_config.pages_per_block)
        self.state_manager = StateManager(cache_config.num_state_slots) if needs_state else None
        self.prefix_cache: PrefixCache = make_prefix_cache(cache_config, self.block_manager, self.state_manager)
        self.waiting: list[SchedulerSequence] = []
        self.running: list[SchedulerSequence] = []
        self._arrivals = 0
        self._admitting: SchedulerSequence | None = None  # the waiting sequence `schedule()` is admitting

    @property
    def trie(self):
        """The `BlockTrie` with prefix caching on (for inspection by tests and tools), else None."""
        return self.prefix_cache if self.cache_config.enable_prefix_caching else None

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
        batch size, KV blocks and state slots allow; admission matches the prefix cache first. A chunk never ends
        inside an image (it stops before the image, or takes it whole). With branch points
        on, a waiting sequence that a prefill piece already in this batch will checkpoint deeper into its prompt
        than its hit skips this step and keeps its place in the queue. Only the first prefill of a batch may be
        cut into a chunk. Finally the prefix cache reserves the checkpoints this forward saves.
        """
        out = SchedulerOutput()
        try:
            self._schedule(out)
        except Exception as exc:  # a fault must fail requests, never stall the engine (the step would repeat it)
            failed = self.cancel(out)  # drops this call's pins and reservations, fails what it scheduled
            culprit = self._admitting
            if culprit is not None and not culprit.is_finished:  # the waiting sequence whose admission raised
                self.finish(culprit, SequenceStatus.ABORTED, 'error')
                failed.append(culprit)
            return SchedulerOutput(rejected=out.rejected + [(seq, f'scheduling failed: {exc!r}') for seq in failed])
        finally:
            self._admitting = None
        return out

    def _schedule(self, out: SchedulerOutput) -> None:
        budget = self.config.max_prefill_token_num
        max_batch, draft_room, chunk = self.config.max_batch_size, self._draft_room, self.prefix_cache.chunk
        for seq in list(self.running):
            if seq.status != SequenceStatus.RUNNING or len(out.seqs) >= max_batch:
                continue
            if seq.num_pending and self._stops_by_length(seq):
                continue  # its in-flight token is its last one (async scheduling)
            remaining = seq.num_remaining
            drafts = len(seq.draft_ids) if remaining == 1 else 0
            n = 1 + drafts if remaining == 1 else min(remaining, budget)
            n = seq.fit_chunk_to_spans(seq.num_computed, chunk(seq, n))
            if drafts and n != 1 + drafts:  # (a decode is never capped; keep the verify piece whole or plain)
                drafts, n = 0, min(n, 1)
            if n == 0 or not self._reserve_blocks(seq, n + draft_room, scheduled=out.seqs):
                continue
            self._add_piece(out, seq, n, drafts)
            budget -= min(n, budget)
        has_prefill = any(n - out.drafts_of(row) > 1 for row, n in enumerate(out.num_new_tokens))
        index = 0
        while (index < len(self.waiting) and budget > 0
               and len(out.seqs) + len(out.logits_hits) < self.config.max_batch_size):
            seq = self._admitting = self.waiting[index]
            try:
                match = self._match(seq)
            except Exception as exc:  # bad input (e.g. an unhashable span) fails its own request only
                self.finish(seq, SequenceStatus.ABORTED, 'error')
                out.rejected.append((seq, f'prefix-cache match failed: {exc!r}'))
                continue
            if self.prefix_cache.waits_for_peer(seq, match, out):
                index += 1  # stays queued (in order) and resumes from the peer's checkpoint next step
                continue
            n = self._admit(seq, match, budget, chunk_ok=not has_prefill, out=out)
            if n is None:
                break
            self.waiting.pop(index)
            self.running.append(seq)
            if n == 0:
                continue  # whole prompt cached: sampled from kept logits (out.logits_hits)
            self._add_piece(out, seq, n, 0)
            budget -= n
            has_prefill = True
        self._admitting = None
        self.prefix_cache.plan_checkpoints(out)

    def _capped(self, num_tokens: int) -> int:
        """Blocks are never reserved past `session_len` (sequences near it get no drafts: `SpeculativeStep`)."""
        return min(num_tokens, self.config.session_len) if self.num_draft_tokens else num_tokens

    @property
    def _draft_room(self) -> int:
        """Tokens reserved past a piece for the draft head's chained positions."""
        return max(self.num_draft_tokens - 1, 0)

    def _add_piece(self, out: SchedulerOutput, seq: SchedulerSequence, n: int, drafts: int) -> None:
        out.seqs.append(seq)
        out.num_new_tokens.append(n)
        if self.num_draft_tokens:
            out.num_drafts.append(drafts)
            out.draft_cuts += [StateCut(seq, seq.num_computed + o, seq.draft_slots[o - 1])
                               for o in range(1, drafts + 1)]

    # ---- applying a forward's result --------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: list[SampledToken]) -> list[SequenceUpdate]:
        """The forward ran: advance every scheduled sequence by the tokens it fed, append the sampled tokens and
        check stops. Returns one update per sampled row, for the engine to deliver at once; no cache bookkeeping
        happens here (the client does not wait for it). A verify piece (drafts fed) advances by the tokens its
        verified run committed instead, and plans its state fix-up (`out.draft_fixups`)."""
        verify = {}
        for row, (seq, n) in enumerate(zip(out.seqs, out.num_new_tokens)):
            drafts = out.drafts_of(row)
            if drafts:
                verify[seq.seq_id] = drafts
                seq.draft_ids, seq.draft_probs = [], None
            else:
                seq.num_computed += n
        updates = []
        for row in sampled:
            drafts = verify.pop(row.seq.seq_id, None)
            if drafts is None:
                updates.append(append_sampled(row, self.config.session_len))
                continue
            update, committed = append_run(row, self.config.session_len)
            self._commit_verified(out, row.seq, drafts, committed)
            self._plan_verified(out, row.seq, drafts, committed)
            updates.append(update)
        for seq in out.seqs:  # verify pieces without a sampled row (their sampling failed): commit the last token
            if seq.seq_id in verify:
                self._commit_verified(out, seq, verify[seq.seq_id], 1)
        return updates

    # ---- async scheduling: `update` in two halves -----------------------------------------------------------------
    def advance(self, out: SchedulerOutput, sampled: list[SchedulerSequence]) -> None:
        """The forward is launched: advance every scheduled sequence by the tokens it fed; each sequence in
        `sampled` (forward rows and logits hits) now has one more pending token (its value is on the device)."""
        for seq, n in zip(out.seqs, out.num_new_tokens):
            seq.num_computed += n
        for seq in sampled:
            seq.num_pending += 1

    def settle(self, sampled: list[SampledToken]) -> list[SequenceUpdate]:
        """The tokens of an advanced forward reached the host: append each one (the oldest pending token of its
        sequence) and check stops, as `update` does. A sequence that stopped while a later, already launched forward
        fed its pending token gets that piece rolled back (the forward's token is discarded, never emitted).
        Sequences finished meanwhile (aborted, failed) are skipped."""
        updates = []
        for row in sampled:
            seq = row.seq
            if seq.is_finished:
                continue
            seq.num_pending -= 1
            update = append_sampled(row, self.config.session_len)
            if update.finish_reason is not None and seq.num_pending:
                self._roll_back_piece(seq)
            updates.append(update)
        return updates

    def _roll_back_piece(self, seq: SchedulerSequence) -> None:
        """Undo a launched decode piece of a sequence that turned out to have stopped before it: the piece's KV
        position is past the sequence's tokens (never read) and its state write went to the dummy row (the engine
        masks it on the device), so only the host bookkeeping and the block reserved for it go back."""
        seq.num_pending -= 1
        seq.num_computed -= 1
        keep = -(-self._capped(seq.num_computed) // self.block_size)
        if len(seq.block_ids) > keep:
            self.block_manager.free(seq.block_ids[keep:])
            del seq.block_ids[keep:]

    def _stops_by_length(self, seq: SchedulerSequence) -> bool:
        """Its pending tokens reach `max_new_tokens` or `session_len` (`append_sampled` will stop it)."""
        return (seq.num_generated + seq.num_pending >= seq.sampling.max_new_tokens
                or seq.num_tokens + seq.num_pending >= self.config.session_len)

    def can_schedule_ahead(self) -> bool:
        """Whether `schedule()` may run while tokens are pending: the next piece of every running sequence fits in
        the free KV blocks, so it preempts no sequence (a pending token cannot be recomputed from the host)."""
        budget, need = self.config.max_prefill_token_num, 0
        for seq in self.running:
            n = 1 if seq.num_remaining == 1 else min(seq.num_remaining, budget)
            need += self._num_blocks_needed(seq, n)
        return self.block_manager.can_allocate(need)

    def _plan_verified(self, out: SchedulerOutput, seq: SchedulerSequence, drafts: int, committed: int) -> None:
        first = seq.num_computed - committed
        slots = seq.draft_slots

        def slot_of(step: int) -> int:  # the cut after offset o = step - first, or the runtime row after all fed
            return slots[step - first - 1] if step - first <= drafts else seq.state_slot
        self.prefix_cache.plan_verified(seq, first, seq.num_computed, slot_of, out.verified)

    @staticmethod
    def _commit_verified(out: SchedulerOutput, seq: SchedulerSequence, drafts: int, committed: int) -> None:
        """`committed` of the 1 + `drafts` fed tokens are kept: the state after them is the cut at that offset
        (spare row committed - 1), or the runtime row itself when every fed token was kept."""
        seq.num_computed += committed
        if committed <= drafts:
            out.draft_fixups.append((seq.draft_slots[committed - 1], seq.state_slot))

    def commit(self, out: SchedulerOutput, updates: list[SequenceUpdate],
               prompt_logits: PromptLogits | None = None) -> ReplyPlan:
        """The forward and its save copies are queued: attach blocks, publish and unpin checkpoints, keep the
        prompt-end logits (`prompt_logits(seq)` gives the last prompt position's logits of a sampled sequence).
        Returns the reply-save plan of the sequences that stopped; queue its copies, then `release` it."""
        self.prefix_cache.commit(out, prompt_logits)
        self.prefix_cache.publish(out.verified)
        self._drop_block_pins(out)
        return self.stop([(u.seq, u.finish_reason) for u in updates if u.finish_reason is not None])

    def stop(self, finishing: list[tuple[SchedulerSequence, str]]) -> ReplyPlan:
        """Sequences that stopped (`commit` passes those of its updates): reserve their reply checkpoints (before
        their slots are reused). Queue the plan's copies, then `release` it."""
        plan = ReplyPlan(finishing=list(finishing))
        if finishing:
            self.prefix_cache.plan_replies([seq for seq, _ in finishing], plan)
        return plan

    def release(self, plan: ReplyPlan, copied: bool = True) -> None:
        """The reply saves are queued (`copied`) or failed: publish or drop their checkpoints, then finish the
        stopped sequences and free their blocks and slots."""
        if copied:
            self.prefix_cache.publish(plan)
        else:
            self.prefix_cache.discard(plan)
        for seq, reason in plan.finishing:
            self.finish(seq, SequenceStatus.FINISHED, reason)

    def cancel(self, out: SchedulerOutput) -> list[SchedulerSequence]:
        """The forward failed: drop its reservations and pins (nothing was published) and fail every sequence of
        its batch (status ABORTED, reason 'error'). Returns those sequences."""
        self.prefix_cache.discard(out)
        self.prefix_cache.discard(out.verified)
        self._drop_block_pins(out)
        failed = [seq for seq in out.seqs + [seq for seq, _ in out.logits_hits] if not seq.is_finished]
        for seq in failed:
            self.finish(seq, SequenceStatus.ABORTED, 'error')
        return failed

    def _drop_block_pins(self, out: SchedulerOutput) -> None:
        if out.block_pins:
            self.block_manager.free(out.block_pins)
            self._pinned_blocks.subtract(out.block_pins)
            self._pinned_blocks = +self._pinned_blocks
            out.block_pins = []

    # ---- admission --------------------------------------------------------------------------------------------
    def _num_blocks_needed(self, seq: SchedulerSequence, n: int) -> int:
        total = -(-self._capped(seq.num_computed + n) // self.block_size)
        return max(0, total - len(seq.block_ids))

    def _match(self, seq: SchedulerSequence) -> PrefixMatch:
        """The prefix-cache match of a waiting sequence. Its peers (branch points) are the running sequences and
        the first few queued ones: a prefix it shares with a request still queued is a branch point too, so that
        request can resume there instead of recomputing it."""
        queued = [s for s in self.waiting[:_MAX_QUEUED_PEERS + 1] if s is not seq][:_MAX_QUEUED_PEERS]
        return self.prefix_cache.match(seq, peers=self.running + queued)

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
        cache = self.prefix_cache
        logits_hit = match.num_tokens == seq.num_tokens
        remaining = seq.num_tokens - match.num_tokens
        n = remaining if remaining <= budget else (budget if chunk_ok else 0)
        if not logits_hit:
            n = cache.admission_chunk(seq, match, n)
            if n:
                n = seq.fit_chunk_to_spans(match.num_tokens, n)  # chunks never split an image
            if n == 0:
                return None
        shared = cache.acquire(seq, match)
        # The draft head recomputes position hit - 1; at an aligned hit that is the last shared block: copy it.
        copied = shared[-1:] if self.num_draft_tokens and match.num_tokens % self.block_size == 0 else []
        need = -(-self._capped(match.num_tokens + n + self._draft_room) // self.block_size) - len(shared) \
            + len(copied)
        slots: list[int] = []
        ok = self.block_manager.can_allocate(need) or cache.evict_blocks(need)
        if ok and self.state_manager is not None:
            slots = self._allocate_slots(1 + self.num_draft_tokens)
            ok = bool(slots)
        if not ok:
            cache.rollback(seq, match)
            return None
        seq.block_ids = shared[:len(shared) - len(copied)] + self.block_manager.allocate(need)
        if copied:  # the shared reference is held until the copy is queued (dropped in `commit` / `cancel`)
            out.kv_restores.append((copied[0], seq.block_ids[len(shared) - 1]))
            out.block_pins.append(copied[0])
            self._pinned_blocks[copied[0]] += 1
        seq.state_slot = slots[0] if slots else None
        seq.draft_slots = slots[1:]
        seq.needs_draft_overlap = bool(self.num_draft_tokens) and match.num_tokens > 0
        seq.num_computed = match.num_tokens
        seq.status = SequenceStatus.RUNNING
        first = seq.num_preemptions == 0
        if first:
            seq.num_cached = match.num_tokens
        cache.record_admission(seq, match, first, out)
        return n

    def _allocate_slots(self, count: int) -> list[int]:
        """`count` state slots (the runtime row, then the spare draft rows), or [] with nothing held."""
        slots = []
        for _ in range(count):
            slot = self.prefix_cache.allocate_slot()
            if slot is None:
                for held in slots:
                    self.state_manager.free(held)
                return []
            slots.append(slot)
        return slots

    # ---- memory -----------------------------------------------------------------------------------------------
    def _reserve_blocks(self, seq: SchedulerSequence, n: int, scheduled: list[SchedulerSequence]) -> bool:
        """Make room for `n` more tokens of a running sequence: evict cached prefixes, then preempt from the tail
        of `running`."""
        need = self._num_blocks_needed(seq, n)
        if need == 0:  # most decode steps: the piece fits in the blocks the sequence holds
            return True
        while not self.block_manager.can_allocate(need):
            if self.prefix_cache.evict_blocks(need):
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
        self.prefix_cache.on_released(seq)
        if seq.block_ids:
            self.block_manager.free(seq.block_ids)
            seq.block_ids = []
        if seq.state_slot is not None and self.state_manager is not None:
            self.state_manager.free(seq.state_slot)
            seq.state_slot = None
        for slot in seq.draft_slots:
            self.state_manager.free(slot)
        seq.draft_slots, seq.draft_ids, seq.draft_probs, seq.needs_draft_overlap = [], [], None, False

    # ---- invariants -------------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """free + request-owned + cache-owned (trie nodes, checkpoints) = total, for KV blocks and for state slots."""
        block_owners: Counter = Counter()
        slot_owners: Counter = Counter()
        for seq in self.running + self.waiting:
            block_owners.update(seq.block_ids)
            if seq.state_slot is not None:
                slot_owners[seq.state_slot] += 1
            slot_owners.update(seq.draft_slots)
        self.prefix_cache.check_integrity()
        cache_blocks, cache_slots = self.prefix_cache.owners()
        block_owners.update(cache_blocks)
        block_owners.update(self._pinned_blocks)
        slot_owners.update(cache_slots)
        self.block_manager.check_integrity(block_owners)
        if self.state_manager is not None:
            self.state_manager.check_integrity(slot_owners)
