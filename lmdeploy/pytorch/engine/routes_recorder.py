"""Which sequences record routed experts, and how a forward's record reaches them.

Owned by the `Engine`; runs on the engine thread. Order within a step: `wants(seqs)` sets the forward's
`ModelInputs.record_routed_experts` -> the forward returns `[T, num_moe_layers, top_k]` rows in packed-batch order ->
`store` writes each sequence's rows at its positions `[num_computed, num_computed + n)` (before the sequences
advance) -> at finish `result` gives a requesting sequence's rows `[0, num_tokens - 1)` (fewer when aborted).

A sequence records when its request asked, or when the prefix cache keeps routes (engine flag and prefix caching
on: cached blocks and checkpoints then carry the routes of their tokens for later hits, and a hit replays them into
the sequence's rows at admission, `paging/block_trie/route_store.py`). With the engine flag off,
nothing is recorded and a request that asks is refused. Models without MoE layers record nothing: their result
has no layer column.
"""
from __future__ import annotations

import numpy as np

from ..config import ModelConfig
from ..messages import SamplingParams, SchedulerSequence
from ..routed_experts import ROUTE_DTYPE, RoutedExperts


class RoutesRecorder:

    def __init__(self, model_config: ModelConfig, enabled: bool, keep_in_cache: bool):
        self.enabled = enabled
        self.row_shape = (model_config.num_moe_layers, model_config.moe_top_k)
        self.has_moe = model_config.num_moe_layers > 0
        # Every sequence records: the prefix cache stores the routes of whatever it caches.
        self.record_all = enabled and keep_in_cache and self.has_moe

    @property
    def bytes_per_token(self) -> int:
        """Host memory one position's row takes (per cached token, when the prefix cache keeps routes)."""
        return int(np.prod(self.row_shape)) * np.dtype(ROUTE_DTYPE).itemsize if self.enabled else 0

    def validate(self, sampling: SamplingParams) -> None:
        if sampling.return_routed_experts and not self.enabled:
            raise ValueError('return_routed_experts needs the engine started with enable_return_routed_experts '
                             '(--enable-return-routed-experts)')

    def attach(self, seq: SchedulerSequence) -> None:
        """Give `seq` its (empty) record if it records."""
        if self.has_moe and self.enabled and (self.record_all or seq.sampling.return_routed_experts):
            seq.routed_experts = RoutedExperts(*self.row_shape)

    @staticmethod
    def wants(seqs: list[SchedulerSequence]) -> bool:
        return any(seq.routed_experts is not None for seq in seqs)

    @staticmethod
    def store(seqs: list[SchedulerSequence], num_new_tokens: list[int], rows: np.ndarray | None) -> None:
        """Each recording sequence's rows of this forward, at the positions it fed (call before it advances).

        The engine refuses the routed-experts flag together with speculative decoding (MTP): a verify forward also
        routes draft tokens that may be rejected, and only accepted positions may ever reach a sequence's rows."""
        if rows is None:
            return
        start = 0
        for seq, n in zip(seqs, num_new_tokens):
            if seq.routed_experts is not None:
                seq.routed_experts.write(seq.num_computed, rows[start:start + n])
            start += n

    def result(self, seq: SchedulerSequence) -> np.ndarray | None:
        """What a finished request that asked returns: rows of every position a forward ran or a hit replayed,
        `[0, min(len(rows), num_tokens - 1))` (a finished request computed all but its last token). The rows it
        recorded, not `num_computed`: a request aborted while preempted (a server's stop string may abort it a step
        late) still returns the rows of the positions it computed before."""
        if not seq.sampling.return_routed_experts:
            return None
        if seq.routed_experts is None:  # no MoE layer: no column
            return np.zeros((min(seq.num_computed, seq.num_tokens - 1), *self.row_shape), dtype=ROUTE_DTYPE)
        return seq.routed_experts.rows(0, min(len(seq.routed_experts), seq.num_tokens - 1))
