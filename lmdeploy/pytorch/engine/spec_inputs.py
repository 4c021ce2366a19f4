"""Host-side plans of a speculative (MTP) step: which rows of the verify forward give logits and hidden states, and
the draft head's inputs after the scheduler applied the verified tokens.

Owns nothing persistent; reads sequences, never mutates them. Order inside one engine step (`Engine._run_forward`):
`plan_verify` (after `InputsMaker.make`) -> verify forward -> `Scheduler.update` -> `plan_head` -> the head's
catch-up forward -> `plan_chain` per chained draft.

Row conventions (see `models/mtp.py`): the head's row at position t reads the target's pre-norm hidden h_t and the
token x_{t+1}, writes the head's KV at position t and predicts x_{t+2}. After a step that committed positions
[old, new) of a sequence, the catch-up runs rows old .. new - 1 (tokens x_{old+1} .. x_new all known once the
verified tokens are appended; x_new is the last emitted one), plus row old - 1 right after a prefix-cache hit (its
hidden comes from the restored state row, see `CacheEngine.mtp_hidden`). So the head's KV at every committed
position t < new is exact, computed from exactly (h_t, x_{t+1}). The chained drafts then write positions new ..
new + K - 2, past every committed one (the next catch-up overwrites them).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ..messages import SchedulerSequence
from ..model_inputs import ModelInputs
from ..paging.scheduler_output import SchedulerOutput


def can_speculate(seq: SchedulerSequence) -> bool:
    """Whether verify-and-accept reproduces this request's sampling exactly: temperature / top-k / top-p / min-p (or
    greedy) only, with or without logprobs (those of every emitted token come from the verify forward's logits).
    Penalties, logit bias and grammars make the next-token distribution depend on the tokens before it inside the
    run, so those requests decode one token per step (no drafts); so does a request still under
    `min_new_tokens`."""
    p = seq.sampling
    return (p.repetition_penalty == 1.0 and not p.has_output_penalties and not p.logit_bias
            and p.grammar is None and seq.grammar_state is None and seq.num_generated >= p.min_new_tokens)


class VerifyPlan(NamedTuple):
    """One verify forward. Batch row b's fed tokens are packed rows [starts[b], starts[b] + q_lens[b])."""
    starts: list[int]
    old_computed: list[int]        # each batch row's num_computed before the forward
    overlap: list[bool]            # the head must also recompute position old_computed - 1 (after a hit)
    overlap_slots: list[int]       # their state rows (the hidden h_{old-1} is read there before the forward)
    hidden_rows: torch.Tensor      # [B] packed row of each batch row's last fed token -> mtp_hidden[state_ids]
    cut_rows: torch.Tensor         # [C] packed row of the last token before each state cut -> mtp_hidden[cut_slots]
    cut_slots: torch.Tensor        # [C]
    logits_rows: torch.Tensor      # per sampled sequence, its last real token's row and its draft rows
    num_drafts: list[int]          # per sampled sequence (in sampled order)
    draft_ids: list[list[int]]
    draft_probs: list[object]      # per sampled sequence: [d, V] device tensor (sampled requests) or None
    wants_logprobs: list[bool]     # per sampled sequence: its request asks for logprobs


def plan_verify(out: SchedulerOutput, inputs: ModelInputs, sampled: list[SchedulerSequence]) -> VerifyPlan:
    starts = inputs.cu_seqlens_q[:-1].tolist()
    row_of = {seq.seq_id: b for b, seq in enumerate(out.seqs)}
    hidden_rows = [start + n - 1 for start, n in zip(starts, out.num_new_tokens)]
    cuts = inputs.state_cuts
    cut_rows = [starts[r] + o - 1 for r, o in zip(cuts.rows, cuts.offsets)] if cuts is not None else []
    cut_slots = list(cuts.slots) if cuts is not None else []
    logits_rows, num_drafts, draft_ids, draft_probs = [], [], [], []
    for seq in sampled:
        b = row_of[seq.seq_id]
        d = out.drafts_of(b)
        real = starts[b] + out.num_new_tokens[b] - d - 1
        logits_rows += range(real, real + d + 1)
        num_drafts.append(d)
        draft_ids.append(list(seq.draft_ids[:d]))
        draft_probs.append(seq.draft_probs if d else None)
    overlap = [seq.needs_draft_overlap for seq in out.seqs]
    return VerifyPlan(
        starts=starts, old_computed=[seq.num_computed for seq in out.seqs], overlap=overlap,
        overlap_slots=[seq.state_slot for seq, o in zip(out.seqs, overlap) if o],
        hidden_rows=torch.tensor(hidden_rows, dtype=torch.int64), cut_rows=torch.tensor(cut_rows, dtype=torch.int64),
        cut_slots=torch.tensor(cut_slots, dtype=torch.int64), logits_rows=torch.tensor(logits_rows, dtype=torch.int64),
        num_drafts=num_drafts, draft_ids=draft_ids, draft_probs=draft_probs,
        wants_logprobs=[seq.sampling.logprobs is not None for seq in sampled])


def uniform_draft_slots(out: SchedulerOutput, inputs: ModelInputs, k: int) -> torch.Tensor | None:
    """The verify forward's cut slots `[B, K]` (`ModelInputs.draft_state_slots`) when every row feeds exactly K
    drafts and the forward has no other state cut and no image; None otherwise (the cuts stay `state_cuts`)."""
    if not k or not out.seqs or out.state_cuts or len(out.draft_cuts) != k * len(out.seqs):
        return None
    if inputs.mm_token_rows is not None or any(n != k + 1 for n in out.num_new_tokens):
        return None
    if any(out.drafts_of(b) != k for b in range(len(out.seqs))):
        return None
    row_of = {seq.seq_id: b for b, seq in enumerate(out.seqs)}
    slots = np.zeros((len(out.seqs), k), dtype=np.int64)
    for seq, step, slot in out.draft_cuts:
        slots[row_of[seq.seq_id], step - seq.num_computed - 1] = slot
    return torch.from_numpy(slots)


class HeadPlan(NamedTuple):
    """The draft head's catch-up forward and who drafts after it."""
    inputs: ModelInputs | None     # None: no row to run
    hidden_index: torch.Tensor     # [T] row of cat([verify hidden, overlap hidden]) each head row reads
    seqs: list[SchedulerSequence]  # sequences with catch-up rows, in row order
    drafting: list[int]            # indices into `seqs` of the sequences that draft next
    last_rows: torch.Tensor        # [len(drafting)] their last catch-up row


class _Rows:
    """Packs head rows of several sequences into one varlen `ModelInputs`."""

    def __init__(self, page_table, kernel_block_size: int):
        self.page_table, self.kbs = page_table, kernel_block_size
        self.ids, self.positions, self.slots, self.tables, self.q_lens, self.kv_lens = [], [], [], [], [], []

    def add(self, seq: SchedulerSequence, ids: np.ndarray, first: int) -> None:
        pages = self.page_table(seq)
        pos = np.arange(first, first + len(ids), dtype=np.int64)
        self.ids.append(np.asarray(ids, dtype=np.int64))
        self.positions.append(pos)
        self.slots.append(pages[pos // self.kbs] * self.kbs + pos % self.kbs)
        self.tables.append(pages)
        self.q_lens.append(len(ids))
        self.kv_lens.append(first + len(ids))

    def build(self) -> ModelInputs:
        tables = np.zeros((len(self.tables), max(len(t) for t in self.tables)), dtype=np.int64)
        for row, table in enumerate(self.tables):
            tables[row, :len(table)] = table
        cu = np.zeros(len(self.q_lens) + 1, dtype=np.int64)
        cu[1:] = np.cumsum(self.q_lens)
        batch = len(self.q_lens)
        return ModelInputs(
            input_ids=torch.from_numpy(np.concatenate(self.ids)),
            position_ids=torch.from_numpy(np.concatenate(self.positions)),
            q_lens=torch.tensor(self.q_lens, dtype=torch.int64), kv_lens=torch.tensor(self.kv_lens, dtype=torch.int64),
            cu_seqlens_q=torch.from_numpy(cu), block_tables=torch.from_numpy(tables),
            slot_mapping=torch.from_numpy(np.concatenate(self.slots)),
            logits_indices=torch.zeros(0, dtype=torch.int64), state_ids=torch.zeros(batch, dtype=torch.int64),
            is_fresh=torch.zeros(batch, dtype=torch.bool), q_lens_list=list(self.q_lens),
            kv_lens_list=list(self.kv_lens), max_seqlen_q=max(self.q_lens), max_seqlen_k=max(self.kv_lens))


def plan_head(out: SchedulerOutput, verify: VerifyPlan, page_table, kernel_block_size: int, num_verify_rows: int,
              wants_drafts) -> HeadPlan:
    """After `Scheduler.update`: the catch-up rows of every scheduled sequence that committed tokens and has the
    token after them (see the module docstring); `wants_drafts(seq)` picks the ones that draft next."""
    rows = _Rows(page_table, kernel_block_size)
    hidden_index, seqs, drafting, last_rows = [], [], [], []
    overlap_index = num_verify_rows
    total = 0
    for b, seq in enumerate(out.seqs):
        old, new = verify.old_computed[b], seq.num_computed
        has_overlap = verify.overlap[b]
        first = old - 1 if has_overlap else old
        if has_overlap:
            overlap_index += 1
        if seq.is_finished or new <= old or new >= seq.num_tokens:
            continue  # failed, or nothing committed / the token after the last committed one is not known
        if has_overlap:
            hidden_index.append(overlap_index - 1)
        hidden_index += range(verify.starts[b], verify.starts[b] + new - old)
        rows.add(seq, seq.token_array()[first + 1:new + 1], first)
        total += new - first
        if wants_drafts(seq):
            drafting.append(len(seqs))
            last_rows.append(total - 1)
        seqs.append(seq)
    if not seqs:
        return HeadPlan(None, torch.zeros(0, dtype=torch.int64), [], [], torch.zeros(0, dtype=torch.int64))
    return HeadPlan(rows.build(), torch.tensor(hidden_index, dtype=torch.int64), seqs, drafting,
                    torch.tensor(last_rows, dtype=torch.int64))


def plan_chain(seqs: list[SchedulerSequence], step: int, page_table, kernel_block_size: int) -> ModelInputs:
    """Chained draft `step` (1 .. K - 1) of the drafting sequences: one row each at position num_computed + step
    - 1 (its token, the previous draft, is filled in on the device)."""
    rows = _Rows(page_table, kernel_block_size)
    for seq in seqs:
        rows.add(seq, np.zeros(1, dtype=np.int64), seq.num_computed + step - 1)
    return rows.build()
