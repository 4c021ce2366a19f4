"""Turns a scheduler decision into host-side `ModelInputs` and `SamplingInputs` for one forward.

Owns nothing persistent. Runs after `Scheduler.schedule()` and before `ModelAgent.forward()`; reads sequences
but never mutates them.
"""
from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np
import torch

from ..messages import SchedulerSequence
from ..model_inputs import ModelInputs, SamplingInputs, StateCuts
from ..paging.block_manager import BlockManager
from ..paging.scheduler import SchedulerOutput
from .cache_inputs import CacheCheckpointInputs
from .guided_decoding import grammar_bitmask
from .mm_inputs import sequence_mm_inputs


class _MultiModalBatch:
    """Collects the M-RoPE positions and image rows of a forward's multimodal sequences."""

    def __init__(self):
        self.mrope: dict[int, np.ndarray] = {}  # batch token offset of the sequence -> its [3, n] positions
        self.rows: list[np.ndarray] = []
        self.items: list = []

    def add(self, seq: SchedulerSequence, start: int, n: int, offset: int) -> np.ndarray:
        """The sequence's 1-D positions; its 3-D positions and image rows are kept for `attach`."""
        got = sequence_mm_inputs(seq, start, n)
        if got.mrope_positions is not None:
            self.mrope[offset] = got.mrope_positions
        if got.items:
            self.rows.append(got.rows + offset)
            self.items += got.items
        return got.positions

    def attach(self, inputs: ModelInputs) -> None:
        if self.mrope:
            flat = np.broadcast_to(inputs.position_ids.numpy(), (3, inputs.position_ids.numel())).copy()
            for offset, pos in self.mrope.items():
                flat[:, offset:offset + pos.shape[1]] = pos
            inputs.mrope_position_ids = torch.from_numpy(flat)
        if self.items:
            inputs.mm_token_rows = torch.from_numpy(np.concatenate(self.rows))
            inputs.vision_items = self.items


def _fed_ids(seq: SchedulerSequence, start: int, n: int, drafts: int) -> np.ndarray:
    """Token ids a piece feeds: known tokens, then zeros for tokens still in flight (async scheduling: the agent
    writes their sampled values on the device, `TokenFeed`), then the piece's drafts."""
    known = seq.token_array()[start:start + n - drafts]
    if len(known) == n and not drafts:
        return known
    parts = [known, np.zeros(n - drafts - len(known), dtype=np.int64)]
    if drafts:
        parts.append(np.asarray(seq.draft_ids[:drafts], dtype=np.int64))
    return np.concatenate(parts)


class InputsMaker:

    def __init__(self, block_manager: BlockManager, block_size: int, kernel_block_size: int,
                 lora_slots: dict[str, int] | None = None):
        """`lora_slots`: adapter identity (`SchedulerSequence.adapter_name`) -> slot in the LoRA layers."""
        self.block_manager = block_manager
        self.lora_slots = lora_slots or {}
        self.block_size = block_size
        self.kernel_block_size = kernel_block_size
        self.pages_per_block = block_size // kernel_block_size

    def page_table(self, seq: SchedulerSequence) -> np.ndarray:
        """Kernel pages of a sequence's blocks, in order."""
        blocks = self.block_manager.resolve_gpu_block_offsets(seq.block_ids)
        return (blocks[:, None] * self.pages_per_block + np.arange(self.pages_per_block)[None, :]).reshape(-1)

    def make(self, out: SchedulerOutput) -> tuple[ModelInputs, list[SchedulerSequence]]:
        """Model inputs for the batch, and the sequences that sample a token after this forward (in row order).
        Per row only the token ids and the sampled check run in Python; positions, block tables and the slot
        mapping are built for the whole batch at once (a decode step's host cost grows with the batch)."""
        seqs, q_lens = out.seqs, list(out.num_new_tokens)
        num_rows = len(seqs)
        starts = np.fromiter((seq.num_computed for seq in seqs), np.int64, num_rows)
        q = np.asarray(q_lens, dtype=np.int64)
        cu = np.zeros(num_rows + 1, dtype=np.int64)
        np.cumsum(q, out=cu[1:])
        index = np.repeat(starts - cu[:-1], q) + np.arange(cu[-1], dtype=np.int64)  # token index in its sequence
        ids = np.empty(int(cu[-1]), dtype=np.int64)
        positions = index.copy()
        logits_idx, sampled, decode_offsets, decode_ids = [], [], [], []
        offsets, num_drafts = cu.tolist(), out.num_drafts
        mm = _MultiModalBatch()
        for row, seq in enumerate(seqs):
            n, start, offset = q_lens[row], seq.num_computed, offsets[row]
            drafts = num_drafts[row] if num_drafts else 0  # a verify piece: the last token, then its drafts
            tokens = seq.token_ids
            if n == 1 and not drafts:  # a decode (its token in flight under async scheduling: 0, fed on the device)
                decode_offsets.append(offset)
                decode_ids.append(tokens[start] if start < len(tokens) else 0)
            else:
                ids[offset:offset + n] = _fed_ids(seq, start, n, drafts)
            if seq.mm_spans:
                positions[offset:offset + n] = mm.add(seq, start, n, offset)
            if start + n - drafts == len(tokens) + seq.num_pending:
                logits_idx.append(offset + n - 1)
                sampled.append(seq)
        if decode_offsets:  # the decodes' ids in one scatter
            ids[decode_offsets] = decode_ids
        state_ids = [seq.state_slot or 0 for seq in seqs]
        fresh = [seq.num_computed == 0 for seq in seqs]
        block_tables = self._block_tables(seqs)
        kbs = self.kernel_block_size
        rows = np.repeat(np.arange(num_rows, dtype=np.int64), q)
        slots = block_tables[rows, index // kbs] * kbs + index % kbs
        kv = starts + q
        kv_lens = kv.tolist()
        inputs = ModelInputs(
            input_ids=torch.from_numpy(ids), position_ids=torch.from_numpy(positions),
            q_lens=torch.from_numpy(q), kv_lens=torch.from_numpy(kv),
            cu_seqlens_q=torch.from_numpy(cu), block_tables=torch.from_numpy(block_tables),
            slot_mapping=torch.from_numpy(slots),
            logits_indices=torch.tensor(logits_idx, dtype=torch.int64),
            state_ids=torch.tensor(state_ids, dtype=torch.int64), is_fresh=torch.tensor(fresh, dtype=torch.bool),
            q_lens_list=q_lens, kv_lens_list=kv_lens, max_seqlen_q=max(q_lens), max_seqlen_k=max(kv_lens),
            state_cuts=self._state_cuts(out, q_lens, state_ids, fresh), lora_ids=self._lora_ids(out))
        mm.attach(inputs)
        return inputs, sampled

    def _block_tables(self, seqs: list[SchedulerSequence]) -> np.ndarray:
        """[B, max pages] kernel pages of every row's blocks (zero padded), validated in one call."""
        counts = np.fromiter((len(seq.block_ids) for seq in seqs), np.int64, len(seqs))
        blocks = self.block_manager.resolve_gpu_block_offsets(
            list(itertools.chain.from_iterable(seq.block_ids for seq in seqs)))
        ppb = self.pages_per_block
        pages = (blocks[:, None] * ppb + np.arange(ppb)[None, :]).reshape(-1)
        widths = counts * ppb
        tables = np.zeros((len(seqs), int(widths.max(initial=0))), dtype=np.int64)
        first = np.repeat(np.cumsum(widths) - widths, widths)
        tables[np.repeat(np.arange(len(seqs)), widths), np.arange(pages.size) - first] = pages
        return tables

    def _lora_ids(self, out: SchedulerOutput) -> torch.Tensor | None:
        """Each row's adapter slot, or None when no row uses an adapter (LoRA layers then skip entirely)."""
        if not self.lora_slots:
            return None
        slots = [self.lora_slots[seq.adapter_name] if seq.adapter_name is not None else 0 for seq in out.seqs]
        return torch.tensor(slots, dtype=torch.int64) if any(slots) else None

    @staticmethod
    def _state_cuts(out: SchedulerOutput, q_lens: list[int], state_ids: list[int], fresh: list[bool]
                    ) -> StateCuts | None:
        """In-prefill checkpoints and the per-draft-position cuts of verify pieces (same mechanism)."""
        if not out.state_cuts and not out.draft_cuts:
            return None
        row_of = {seq.seq_id: row for row, seq in enumerate(out.seqs)}
        rows, offsets, slots = [], [], []
        for seq, step, slot in out.state_cuts + out.draft_cuts:
            row = row_of[seq.seq_id]
            offset = step - seq.num_computed
            if not 0 < offset < q_lens[row]:
                raise ValueError(f'in-prefill checkpoint at step {step} is outside the fed tokens of sequence '
                                 f'{seq.seq_id}')
            rows.append(row)
            offsets.append(offset)
            slots.append(slot)
        return StateCuts(rows=rows, offsets=offsets, slots=slots, q_lens=list(q_lens), state_ids=list(state_ids),
                         is_fresh=list(fresh))

    def make_cache_inputs(self, out: SchedulerOutput) -> CacheCheckpointInputs | None:
        """This forward's restore/save plans with block ids resolved to validated physical offsets."""
        if not (out.kv_restores or out.state_restores or out.kv_saves or out.state_saves):
            return None
        return CacheCheckpointInputs.build(out.kv_restores, out.state_restores, out.kv_saves, out.state_saves,
                                           self.block_manager.resolve_gpu_block_offsets)


class SamplingRow(NamedTuple):
    """One sampled row's parameters, before they become batch tensors."""
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    penalty_ids: torch.Tensor | None   # ids already in the sequence, when the penalty is on
    banned_ids: torch.Tensor | None    # stop ids not allowed before min_new_tokens
    generator: torch.Generator | None
    logprobs: int | None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    output_ids: torch.Tensor | None = None  # generated ids, when a presence / frequency penalty is on
    min_p: float = 0.0
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None = None


def sampling_row(seq: SchedulerSequence, generators: dict[int, torch.Generator]) -> SamplingRow:
    params = seq.sampling
    bias = None
    if params.logit_bias:
        bias = (torch.tensor([t for t, _ in params.logit_bias], dtype=torch.int64),
                torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32))
    # positional, in `SamplingRow`'s field order (keyword binding doubles the cost of a row; it runs per row per step)
    return SamplingRow(
        0.0 if params.is_greedy else params.temperature, params.top_k, params.top_p, params.repetition_penalty,
        torch.tensor(sorted(set(seq.token_ids)), dtype=torch.int64) if params.repetition_penalty != 1.0 else None,
        torch.tensor(params.stop_token_ids, dtype=torch.int64)
        if params.min_new_tokens and params.stop_token_ids
        and seq.num_generated + seq.num_pending < params.min_new_tokens else None,
        generators.get(seq.seq_id), params.logprobs, params.presence_penalty, params.frequency_penalty,
        torch.tensor(seq.token_ids[seq.num_prompt_tokens:], dtype=torch.int64)
        if params.has_output_penalties else None,
        params.min_p, bias)


def _stack(rows: list[SamplingRow]) -> SamplingInputs:
    """The rows as batch tensors and per-row lists. The rows are transposed into columns in one pass (a decode
    batch's host cost grows with the batch); optional columns are None when no row uses them."""
    col = dict(zip(SamplingRow._fields, map(list, zip(*rows)))) if rows else {f: [] for f in SamplingRow._fields}
    temperature, min_p, logit_bias = col['temperature'], col['min_p'], col['logit_bias']
    penalties = any(ids is not None for ids in col['output_ids'])
    return SamplingInputs(
        temperature=torch.tensor(temperature, dtype=torch.float32),
        top_k=torch.tensor(col['top_k'], dtype=torch.int64),
        top_p=torch.tensor(col['top_p'], dtype=torch.float32),
        repetition_penalty=torch.tensor(col['repetition_penalty'], dtype=torch.float32),
        penalty_ids=col['penalty_ids'], banned_ids=col['banned_ids'], generators=col['generator'],
        max_num_logprobs=max((n for n in col['logprobs'] if n is not None), default=-1),
        all_greedy=all(t == 0.0 for t in temperature),
        output_ids=col['output_ids'] if penalties else None,
        presence_penalty=torch.tensor(col['presence_penalty'], dtype=torch.float32) if penalties else None,
        frequency_penalty=torch.tensor(col['frequency_penalty'], dtype=torch.float32) if penalties else None,
        min_p=torch.tensor(min_p, dtype=torch.float32) if any(m > 0 for m in min_p) else None,
        logit_bias=logit_bias if any(bias is not None for bias in logit_bias) else None)


def _build(seqs: list[SchedulerSequence], generators: dict[int, torch.Generator]) -> SamplingInputs:
    inputs = _stack([sampling_row(seq, generators) for seq in seqs])
    inputs.token_bitmask = grammar_bitmask(seqs)
    return inputs


def make_sampling_inputs(seqs: list[SchedulerSequence], generators: dict[int, torch.Generator]
                         ) -> tuple[SamplingInputs, dict[int, str]]:
    """Sampling parameters for the rows of `seqs` (the sequences sampled this forward), and the error of every row
    that could not be built, by its index in `seqs`. Such a row is left out of the inputs: its request fails alone
    and the rest of the forward runs (admission validates parameters, so this is the last line of defence). The
    batch is built in one pass; only when that fails is each row built alone to find the culprits."""
    try:
        return _build(seqs, generators), {}
    except Exception:  # any failure here belongs to some row; find which below
        pass
    rejected = {i: error for i, seq in enumerate(seqs) if (error := _row_error(seq, generators)) is not None}
    return _build([seq for i, seq in enumerate(seqs) if i not in rejected], generators), rejected


_ROW_DTYPES = {'temperature': torch.float32, 'top_k': torch.int64, 'top_p': torch.float32,
               'repetition_penalty': torch.float32, 'presence_penalty': torch.float32,
               'frequency_penalty': torch.float32, 'min_p': torch.float32}


def _row_error(seq: SchedulerSequence, generators: dict[int, torch.Generator]) -> str | None:
    """Why one row's sampling inputs cannot be built (naming the field where one is to blame), or None."""
    try:
        row = sampling_row(seq, generators)
        for name, dtype in _ROW_DTYPES.items():
            try:
                torch.tensor([getattr(row, name)], dtype=dtype)
            except Exception as exc:
                return f'{name}={getattr(row, name)!r} is outside what the sampling kernels accept ({exc})'
        _stack([row])
    except Exception as exc:
        return f'invalid sampling inputs: {type(exc).__name__}: {exc}'
    return None


def drop_sampled_rows(inputs: ModelInputs, sampled: list[SchedulerSequence], rejected: dict[int, str]
                      ) -> list[SchedulerSequence]:
    """Stop sampling the rejected rows (their tokens are still computed, so their KV and state stay exact);
    returns the sequences still sampled, in row order."""
    keep = [i for i in range(len(sampled)) if i not in rejected]
    inputs.logits_indices = inputs.logits_indices[keep]
    return [sampled[i] for i in keep]
