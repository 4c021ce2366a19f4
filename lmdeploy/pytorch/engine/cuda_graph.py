"""CUDA graphs for decode forwards: capture the model once per padded batch size, then replay.

Owns: static input buffers (one set, sized for the largest graph), the captured graphs and their output buffers.
Used by `ModelAgent.run_model` for pure decode batches on CUDA unless `eager_mode`; never touches scheduler state.

A decode batch of `B` sequences is padded to the smallest capture size `G >= B` (1, 2, 4, 8, then multiples of 16
up to `max_batch_size`). Padding rows are harmless by construction of the kernels' contracts: `kv_lens = 0` (paged
decode attention writes zeros and reads nothing), `slot_mapping = -1` (KV fill writes nothing), `state_ids = 0` (row
0 of the state pool is a reserved dummy that no sequence owns) and token / position 0.

The engine captures every size at start-up (`capture_all`): one eager warm-up run per size on all-padding inputs
(it compiles / autotunes every kernel for exactly the captured shapes and writes nothing a sequence owns), then the
capture. A size that was not captured yet is handled on first use the same way, except that the eager run is the
real step itself (capture executes nothing, so the step is not applied twice). A decode at a captured size copies
its inputs into the buffers and replays. Every capture shares one memory pool; everything runs on the caller's
current stream (the forward stream).
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from ..model_inputs import ModelInputs, StepContext

logger = logging.getLogger('lmdeploy')


def capture_sizes(max_batch_size: int) -> list[int]:
    """Padded batch sizes that get a graph: 1, 2, 4, 8, 16, 32, 48, ... capped by (and including) the maximum."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch_size]
    sizes += list(range(16, max_batch_size, 16))
    return sorted(set(sizes) | {max_batch_size})


class _StaticInputs:
    """Device buffers a captured graph reads; `view(G)` is the `ModelInputs` of a graph of size G."""

    def __init__(self, max_batch: int, max_pages: int, device: torch.device):
        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(*shape, dtype=dtype, device=device)
        self.input_ids = zeros(max_batch)
        self.position_ids = zeros(max_batch)
        self.kv_lens = zeros(max_batch)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
        self.state_ids = zeros(max_batch)
        self.is_fresh = zeros(max_batch, dtype=torch.bool)
        self.block_tables = zeros(max_batch, max_pages)
        self.q_lens = torch.ones(max_batch, dtype=torch.int64, device=device)
        self.cu_seqlens_q = torch.arange(max_batch + 1, dtype=torch.int64, device=device)
        self.logits_indices = torch.arange(max_batch, dtype=torch.int64, device=device)
        self.max_pages = max_pages

    def view(self, size: int) -> ModelInputs:
        return ModelInputs(
            input_ids=self.input_ids[:size], position_ids=self.position_ids[:size], q_lens=self.q_lens[:size],
            kv_lens=self.kv_lens[:size], cu_seqlens_q=self.cu_seqlens_q[:size + 1],
            block_tables=self.block_tables[:size], slot_mapping=self.slot_mapping[:size],
            logits_indices=self.logits_indices[:size], state_ids=self.state_ids[:size],
            is_fresh=self.is_fresh[:size], q_lens_list=[1] * size, kv_lens_list=[1] * size, max_seqlen_q=1,
            max_seqlen_k=1)

    def fill(self, inputs: ModelInputs | None, size: int) -> None:
        """Copy a decode batch into rows [0, B) and make rows [B, size) padding (`inputs=None`: all padding)."""
        b = 0 if inputs is None else inputs.batch_size
        if b:
            width = inputs.block_tables.size(1)
            self.input_ids[:b].copy_(inputs.input_ids, non_blocking=True)
            self.position_ids[:b].copy_(inputs.position_ids, non_blocking=True)
            self.kv_lens[:b].copy_(inputs.kv_lens, non_blocking=True)
            self.slot_mapping[:b].copy_(inputs.slot_mapping, non_blocking=True)
            self.state_ids[:b].copy_(inputs.state_ids, non_blocking=True)
            self.is_fresh[:b].copy_(inputs.is_fresh, non_blocking=True)
            self.block_tables[:b, :width].copy_(inputs.block_tables, non_blocking=True)
        if size > b:
            self.input_ids[b:size].zero_()
            self.position_ids[b:size].zero_()
            self.kv_lens[b:size].zero_()
            self.slot_mapping[b:size].fill_(-1)
            self.state_ids[b:size].zero_()
            self.is_fresh[b:size].zero_()


class CUDAGraphRunner:
    """Runs decode forwards of `model` through captured CUDA graphs (see the module docstring)."""

    def __init__(self, model: nn.Module, make_context: Callable[[ModelInputs], StepContext], max_batch_size: int,
                 max_pages: int, device: torch.device):
        self.model = model
        self.make_context = make_context
        self.sizes = capture_sizes(max_batch_size)
        self.max_batch_size = max_batch_size
        self.device = device
        self.static = _StaticInputs(max_batch_size, max_pages, device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.num_replays = 0

    def padded_size(self, batch_size: int) -> int:
        return next(s for s in self.sizes if s >= batch_size)

    def supports(self, inputs: ModelInputs) -> bool:
        """Pure decode batches that fit the static buffers."""
        return (inputs.is_decode and inputs.state_cuts is None and inputs.input_ids.numel() == inputs.batch_size
                and 0 < inputs.batch_size <= self.max_batch_size
                and inputs.block_tables.size(1) <= self.static.max_pages)

    def run(self, inputs: ModelInputs) -> torch.Tensor:
        """Hidden states [B, hidden] of a decode batch (`supports(inputs)` must hold)."""
        b = inputs.batch_size
        size = self.padded_size(b)
        self.static.fill(inputs, size)
        entry = self.graphs.get(size)
        if entry is None:
            static_inputs = self.static.view(size)
            out = self.model(self.make_context(static_inputs))  # the real step, eager, on the captured shapes
            self._capture(size, static_inputs)
            return out[:b]
        graph, out = entry
        graph.replay()
        self.num_replays += 1
        return out[:b]

    def capture_all(self) -> None:
        """Capture every size up front, largest first (so smaller graphs reuse its pool memory). Each warm-up run
        is all padding, so it writes nothing any sequence owns: no KV (slot -1) and only the dummy state row."""
        for size in reversed(self.sizes):
            if size not in self.graphs:
                self.static.fill(None, size)
                static_inputs = self.static.view(size)
                self.model(self.make_context(static_inputs))  # compile / autotune for exactly these shapes
                self._capture(size, static_inputs)

    def _capture(self, size: int, static_inputs: ModelInputs) -> None:
        stream = torch.cuda.current_stream(self.device)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode='thread_local'):
            out = self.model(self.make_context(static_inputs))
        self.graphs[size] = (graph, out)
        logger.info('captured a CUDA graph for decode batch %d', size)
