"""Async scheduling (vLLM's name; `PytorchEngineConfig.async_scheduling`): the host overlaps the device.

Owns the device side of feeding one forward's sampled tokens to the next one, and the record of a forward still in
flight. The engine's step with async scheduling on (`engine_step.py`, `Engine._run_async`):

    schedule step N+1 (step N still runs on the device; its tokens are pending) -> make inputs -> launch N+1, whose
    pieces that feed a pending token of N read it on the device (`TokenFeed`) -> settle N (wait for its tokens: a
    pinned copy and an event, `DeviceTokens`; append them, check stops, deliver, commit, release) -> N+1 stays in
    flight when it is `deferrable`, else it settles at once.

Exactness: a sequence whose pending token stops it is still in step N+1. Its state write there goes to the dummy
state row (`TokenFeed.apply` checks the stop ids on the device), its KV write lands past its tokens (never read),
its hidden row is zeroed before the head (the discarded sample reads finite logits), and `Scheduler.settle` rolls
its piece back on the host: the sequence ends exactly as the synchronous loop leaves it, and its reply checkpoint
holds the state after its own tokens. Sequences whose next inputs need token values on the host (penalties, a
grammar, stop sequences, logprobs, collected logits, routed experts) are never left in flight: a step that
samples one settles at once. Sequences that stop by length are not scheduled past their last token.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..messages import SchedulerSequence
from ..model_inputs import ModelInputs
from ..paging.scheduler_output import SampledToken, SchedulerOutput
from .device_streams import register_payload


class DeviceTokens:
    """Sampled ids of a launched forward: the device tensor (fed to the next forward) and a non-blocking copy to
    pinned host memory, recorded by an event on the current (forward) stream; `tolist()` waits for that event only."""

    def __init__(self, ids: torch.Tensor):
        self.device_ids = ids
        self._event = None
        if ids.is_cuda:
            self._host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            self._host.copy_(ids, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = ids

    def tolist(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


class TokenFeed:
    """Where a forward takes tokens sampled by the one before it, on the device. Row i: the token at `token_rows[i]`
    of the packed batch is `source[src_rows[i]]`; it belongs to batch row `batch_rows[i]` and, when that sequence
    samples, to row `logit_rows[i]` of this forward's logits (-1: not sampled). `stop_ids` [F, S] (-1 padded) and
    `can_stop` [F]: the token stops its sequence (`append_sampled`'s stop-id rule), which the host learns only later.

    The host-built indices are the rows of one int64 `table` [5 + S, F] (token, src, batch and logit rows, can_stop
    as 0 / 1, then the S stop-id rows; S = 0: no fed row has stop ids, and `stop_ids`, `can_stop` are None), so the
    feed travels to the device in one copy; the fields are views of it."""

    __slots__ = ('source', 'table')

    def __init__(self, source: torch.Tensor, table: torch.Tensor):
        self.source, self.table = source, table

    token_rows = property(lambda self: self.table[0])
    src_rows = property(lambda self: self.table[1])
    batch_rows = property(lambda self: self.table[2])
    logit_rows = property(lambda self: self.table[3])

    @property
    def can_stop(self) -> torch.Tensor | None:
        return self.table[4] > 0 if self.table.size(0) > 5 else None

    @property
    def stop_ids(self) -> torch.Tensor | None:
        return self.table[5:].t() if self.table.size(0) > 5 else None

    def tensors(self) -> list[torch.Tensor]:
        """The host-built index table (`source` is already on the device, written on the forward stream)."""
        return [self.table]

    def to(self, device: torch.device, non_blocking: bool = False) -> TokenFeed:
        return TokenFeed(self.source, self.table.to(device, non_blocking=non_blocking))

    def apply(self, inputs: ModelInputs) -> torch.Tensor | None:
        """Write the fed tokens into `inputs.input_ids`; rows whose fed token stops their sequence read and write the
        dummy state row 0 instead of their own. Returns that stop mask [F] (None without stop ids). No sync."""
        tokens = self.source[self.src_rows]
        inputs.input_ids[self.token_rows] = tokens.to(inputs.input_ids.dtype)
        stop_ids = self.stop_ids
        if stop_ids is None:
            return None
        stopped = (tokens[:, None] == stop_ids).any(dim=1) & self.can_stop
        rows = self.batch_rows
        inputs.state_ids[rows] = torch.where(stopped, torch.zeros_like(inputs.state_ids[rows]), inputs.state_ids[rows])
        return stopped

    @staticmethod
    def blank(hidden: torch.Tensor, rows: torch.Tensor, stopped: torch.Tensor | None) -> torch.Tensor:
        """Zero the rows (of `hidden`, indexed by `rows`, -1 = none) of stopped sequences: their discarded sample
        then reads finite logits whatever the dummy state row held."""
        if stopped is None:
            return hidden
        n = hidden.size(0)
        mask = torch.zeros(n + 1, dtype=torch.bool, device=hidden.device)
        mask[torch.where(stopped & (rows >= 0), rows, torch.full_like(rows, n))] = True  # row n: a sink
        return hidden.masked_fill_(mask[:n, None], 0)


register_payload(TokenFeed, TokenFeed.tensors)


class LaunchedStep(NamedTuple):
    """A forward launched and advanced (`Scheduler.advance`) but not settled yet."""
    sched: SchedulerOutput
    sampled: list[SchedulerSequence]         # forward rows that sample, in row order
    result: Any                              # ForwardOutput (None: no forward ran)
    hits: list[SampledToken]                 # first tokens of whole-prompt hits (sampled on the host already)
    rejected: list[tuple[SchedulerSequence, str]]
    deferrable: bool                         # may stay in flight while the next step is scheduled


def needs_host_tokens(seq: SchedulerSequence, collects_logits: bool, records_routes: bool) -> bool:
    """The sequence's next inputs or its stop check need the sampled token values on the host."""
    p = seq.sampling
    return (p.repetition_penalty != 1.0 or p.has_output_penalties or p.grammar is not None
            or seq.grammar_state is not None or p.logprobs is not None or bool(p.stop_sequences)
            or collects_logits or records_routes)


def is_deferrable(sched: SchedulerOutput, result, rejected: list, host_bound: bool) -> bool:
    """A launched step may stay in flight: a plain forward whose result the host needs only as sampled tokens (no
    cache copies, checkpoints, pins, whole-prompt hits or failed rows), and no sampled sequence needs its tokens on
    the host before the next step (`needs_host_tokens`)."""
    return (result is not None and getattr(result, 'sampled_ids', None) is not None and not host_bound
            and not rejected and not sched.has_copies and not sched.reserved and not sched.pinned
            and not sched.state_cuts and not sched.logits_hits and not sched.block_pins)


def build_feed(sched: SchedulerOutput, sampled: list[SchedulerSequence], prev: LaunchedStep | None
               ) -> TokenFeed | None:
    """The feed of this step's pieces that take a token `prev` (in flight) sampled. Call before `advance`."""
    if prev is None or prev.result is None or not prev.sampled:
        return None
    src_of = {seq.seq_id: i for i, seq in enumerate(prev.sampled)}
    logit_of = {seq.seq_id: i for i, seq in enumerate(sampled)}
    token_rows, src_rows, batch_rows, logit_rows, stops, can_stop = [], [], [], [], [], []
    offset = 0
    for row, (seq, n) in enumerate(zip(sched.seqs, sched.num_new_tokens)):
        src = src_of.get(seq.seq_id)
        if src is not None and seq.num_pending:
            token_rows.append(offset + seq.num_tokens - seq.num_computed)  # the pending token's place in the piece
            src_rows.append(src)
            batch_rows.append(row)
            logit_rows.append(logit_of.get(seq.seq_id, -1))
            params = seq.sampling
            stops.append(params.stop_token_ids)
            can_stop.append(int(seq.num_generated + 1 > params.min_new_tokens - 1))
        offset += n
    if not token_rows:
        return None
    width = max(map(len, stops))
    pad = (-1,) * width
    stop_rows = list(zip(*[tuple(s) + pad[len(s):] for s in stops])) if width else []
    table = torch.tensor([token_rows, src_rows, batch_rows, logit_rows, can_stop, *stop_rows], dtype=torch.int64)
    return TokenFeed(prev.result.sampled_ids.device_ids, table)
