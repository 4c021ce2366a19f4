"""Checkpoint policy: which steps of which sequences get a state checkpoint, and where its slot comes from.

Owns no records (the trie and `StateCheckpointLifecycle` do); it decides and reserves. Called through `BlockTrie`
(the prefix-cache contract, see `paging/prefix_cache.py`) in step order:
- admission: `waits_for_peer` (branch points in flight), `admission_chunk` / `chunk` (a chunk ends at a branch
  point, and at the end of the prompt's last image), `allocate_slot` (slot allocation with eviction);
- end of `schedule`: `plan` reserves at prefill and chunk ends, at branch points (plus an aligned fallback at an
  unaligned one's block floor), at in-prefill cuts and at the opt-in decode interval;
- `commit`: `keep_prompt_logits`, then `plan_replies` (reply checkpoints of the sequences that stopped).
Every reservation allocates its slot (and, for a step inside a block, its frozen block) or is skipped; it never
preempts a sequence. Eviction itself (which checkpoint or leaf goes) belongs to the lifecycles, not here.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ....prefix_cache_config import PrefixCacheConfig
from ...messages import SchedulerSequence
from ..block_manager import BlockManager
from ..prefix_cache import PrefixMatch, PromptLogits
from ..scheduler_output import CopyPlan, ReservedCheckpoint, SchedulerOutput, StateCut
from ..state_manager import StateManager

if TYPE_CHECKING:
    from .block_trie import BlockTrie


def cut_margin(interval: int) -> int:
    """The least distance of an in-prefill cut from either end of its piece (`CheckpointPolicy._plan_prefill_cuts`):
    an eighth of the interval, at least one token (2048 at the default 16384)."""
    return max(1, interval // 8)


class CheckpointPolicy:

    def __init__(self, trie: BlockTrie, block_manager: BlockManager, state_manager: StateManager | None,
                 config: PrefixCacheConfig):
        self.trie = trie
        self.block_manager = block_manager
        self.state_manager = state_manager
        self.block_size = trie.block_size
        # Block-aligned decode checkpoints every this many tokens (0 = off).
        self.decode_state_interval = config.decode_state_interval
        # In-prefill checkpoints every this many tokens (0 = off), at most `prefill_state_cap` per prompt.
        self.prefill_state_interval = config.prefill_state_interval
        self.prefill_state_cap = config.prefill_state_cap
        self.reply_checkpoints = config.reply_checkpoints

    # ---- branch points ----------------------------------------------------------------------------------------
    def waits_for_peer(self, seq: SchedulerSequence, match: PrefixMatch, out: SchedulerOutput) -> bool:
        """Branch policy, in flight: a prefill piece already scheduled in this forward ends on `seq`'s prompt
        deeper than its hit, where a checkpoint will be saved. `seq` then waits one step and resumes there instead
        of recomputing the same tokens beside it (each wait strictly deepens its next hit, so waits are bounded)."""
        trie = self.trie
        if not trie.is_hybrid or not trie.branch_checkpoints:
            return False
        n = seq.num_tokens
        for peer, k in zip(out.seqs, out.num_new_tokens):
            end = peer.num_computed + k
            if peer.num_computed >= peer.num_prompt_tokens or end <= match.num_tokens or end > n:
                continue  # a decode step, or a piece ending at or before the hit / past the prompt
            # One token must be left to compute, unless the piece is a whole identical prompt with kept logits.
            usable = end < n or (trie.prompt_logits and end == peer.num_tokens)
            if usable and peer.token_ids[:end] == seq.token_ids[:end] and trie.wants_checkpoint(peer, end):
                return True
        return False

    def admission_chunk(self, seq: SchedulerSequence, match: PrefixMatch, n: int) -> int:
        hints = [h for h in (match.junction, self.image_end_hint(seq, match.num_tokens)) if h is not None
                 and h > match.num_tokens]
        seq.checkpoint_hint = min(hints) if hints else None
        return cap_at_hint(seq, n, start=match.num_tokens)

    def image_end_hint(self, seq: SchedulerSequence, after: int) -> int | None:
        """The end of the prompt's last image when a chunk should end there to checkpoint it ("same images, new
        question" then resumes exactly after the images): after `after`, before the prompt's end, not already
        checkpointed. None otherwise."""
        if not seq.mm_spans or not self.trie.is_hybrid:
            return None
        end = seq.mm_spans[-1].end
        if not after < end < seq.num_prompt_tokens or not self.trie.wants_checkpoint(seq, end):
            return None
        return end

    # ---- slots ------------------------------------------------------------------------------------------------
    def allocate_slot(self) -> int | None:
        slot = self.state_manager.allocate()
        while slot is None and self.trie.evict_slot():
            slot = self.state_manager.allocate()
        return slot

    # ---- reservations -----------------------------------------------------------------------------------------
    def plan(self, out: SchedulerOutput) -> None:
        if self.trie.is_hybrid:
            for row, (seq, n) in enumerate(zip(out.seqs, out.num_new_tokens)):
                if not out.drafts_of(row):  # a verify piece ends at a draft position: never a checkpoint
                    self._plan_piece(seq, n, out)

    def _plan_piece(self, seq: SchedulerSequence, n: int, out: SchedulerOutput) -> None:
        """Reserve a checkpoint at the end of a prefill piece (prompt end, chunk end, branch point) or at an
        opt-in decode interval, if wanted and affordable. A piece ending at a branch point takes no in-prefill
        cuts: it is the prefix shared with known requests, which its end checkpoint serves, and the per-prompt cap
        is kept for the prompt's own tokens after it, where its later siblings diverge."""
        step = seq.num_computed + n
        at_branch_point = seq.checkpoint_hint == step
        if seq.checkpoint_hint is not None and step >= seq.checkpoint_hint:
            seq.checkpoint_hint = self.image_end_hint(seq, step)  # a branch point before the last image end
        if n > 1 and not at_branch_point:
            self._plan_prefill_cuts(seq, n, out)
        if at_branch_point:
            self._plan_fallback(seq, step, out)
        if seq.num_computed >= seq.num_prompt_tokens and n == 1:
            interval = self.decode_state_interval
            if not interval or step % interval:
                return  # a decode step off the opt-in interval
        self.reserve(seq, step, out)

    def _plan_prefill_cuts(self, seq: SchedulerSequence, n: int, out: SchedulerOutput) -> None:
        """In-prefill checkpoints: block-aligned steps inside this piece that are multiples of the interval, at
        least `cut_margin` tokens from both of its ends, deepest first, within the per-prompt cap, each in a free
        state row (never by evicting a checkpoint).

        The margin: the piece's start is the checkpoint it resumed from (a hit, the previous chunk end, or 0) and its
        end takes a checkpoint of its own, so a cut near either end saves a later prompt at most `cut_margin`
        tokens of recompute, while any cut makes its forward run eagerly (a state cut has no CUDA graph): on a
        32-layer model that is ~85 ms instead of ~20 ms for a 100-token suffix after a 32K prefix that happens to
        cross a multiple of the interval. Pieces of at most `2 * cut_margin` tokens (every piece a prefill graph can
        run) therefore take no cut."""
        interval = self.prefill_state_interval
        room = self.prefill_state_cap - seq.num_prefill_checkpoints
        if not interval or room <= 0:
            return
        start, end = seq.num_computed, seq.num_computed + n
        margin = cut_margin(interval)
        step = (end - margin) // interval * interval
        while step >= start + margin and room > 0:
            if self.trie.wants_checkpoint(seq, step):
                if not self._reserve_cut(seq, step, out):
                    return
                seq.num_prefill_checkpoints += 1
                room -= 1
            step -= interval

    def _plan_fallback(self, seq: SchedulerSequence, step: int, out: SchedulerOutput) -> None:
        """An unaligned branch point also keeps an aligned checkpoint at its block floor (a state cut in the same
        forward, no frozen block), in a free state row only: when KV pressure evicts the branch point's frozen
        block, its hits resume there (`StateCheckpointLifecycle.fallback`) instead of at the previous checkpoint."""
        floor = step - step % self.block_size
        if floor <= seq.num_computed or floor == step or not self.trie.wants_checkpoint(seq, floor):
            return
        self._reserve_cut(seq, floor, out)

    def _reserve_cut(self, seq: SchedulerSequence, step: int, out: SchedulerOutput) -> bool:
        """Reserve a checkpoint at `step` that a state cut of this forward saves into a free state row (no frozen
        block); False, reserving nothing, when no row is free."""
        slot = self.state_manager.allocate()
        if slot is None:
            return False
        ck = self.trie.reserve_checkpoint(seq, step, slot, None)
        out.reserved.append(ReservedCheckpoint(seq, ck))
        out.state_cuts.append(StateCut(seq, step, slot))
        return True

    def plan_verified(self, seq: SchedulerSequence, first: int, last: int, slot_of, plan: CopyPlan) -> None:
        """Speculative decoding: the deepest decode-interval step a verify piece committed, (first, last], saved from
        the state row that holds it (`slot_of(step)`); draft positions past `last` are never checkpointed."""
        interval = self.decode_state_interval
        if not self.trie.is_hybrid or not interval:
            return
        step = last - last % interval
        if step > first:
            self.reserve(seq, step, plan, src_slot=slot_of(step))

    def reserve(self, seq: SchedulerSequence, step: int, plan: CopyPlan, src_slot: int | None = None) -> None:
        """Reserve a checkpoint of `seq` at `step` with its save copies into `plan`, if wanted and affordable;
        the state is copied from `src_slot` (default: the runtime row)."""
        trie = self.trie
        if not trie.wants_checkpoint(seq, step):
            return
        partial = step % self.block_size != 0
        slot = self.allocate_slot()
        if slot is None:
            trie.note_skipped_checkpoint(seq, step)
            return
        frozen = None
        if partial:
            if not (self.block_manager.can_allocate(1) or trie.evict_blocks(1)):
                self.state_manager.free(slot)
                trie.note_skipped_checkpoint(seq, step)
                return
            frozen = self.block_manager.allocate(1)[0]
        ck = trie.reserve_checkpoint(seq, step, slot, frozen)
        plan.reserved.append(ReservedCheckpoint(seq, ck))
        plan.state_saves.append((seq.state_slot if src_slot is None else src_slot, slot))
        if frozen is not None:
            plan.kv_saves.append((seq.block_ids[step // self.block_size], frozen))

    def plan_replies(self, seqs: list[SchedulerSequence], plan: CopyPlan) -> None:
        """Reserve checkpoints of finishing sequences after every token they consumed (prompt + reply minus the
        last sampled token)."""
        if not self.trie.is_hybrid or not self.reply_checkpoints:
            return
        for seq in seqs:
            if seq.state_slot is not None and seq.num_computed > 0:
                self.reserve(seq, seq.num_computed, plan)

    # ---- logits -----------------------------------------------------------------------------------------------
    def keep_prompt_logits(self, out: SchedulerOutput, prompt_logits: PromptLogits | None) -> None:
        """Attach the last prompt position's logits to the prompt-end checkpoints this forward published."""
        if prompt_logits is None or not out.reserved or not self.trie.prompt_logits:
            return
        for seq, ck in out.reserved:
            if ck.step == seq.num_computed and ck.published:
                logits = prompt_logits(seq)
                if logits is not None:
                    self.trie.keep_logits(ck, logits)


def cap_at_hint(seq: SchedulerSequence, n: int, start: int | None = None) -> int:
    """End the chunk at the sequence's branch-point hint when the chunk would cross it."""
    start = seq.num_computed if start is None else start
    hint = seq.checkpoint_hint
    if hint is not None and start < hint < start + n:
        return hint - start
    return n
