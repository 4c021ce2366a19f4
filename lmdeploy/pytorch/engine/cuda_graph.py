"""CUDA graphs: capture the model once per padded batch shape, then replay (decode batches and small prefills).

Owns: static input buffers (one set, sized for the largest graph), the captured graphs and their output buffers.
Used by `ModelAgent.run_model` on CUDA unless `eager_mode`; never touches scheduler state.

A graph is keyed by `(tokens, sequences)`:

- Decode (every sequence feeds one token): a batch of `B` is padded to the smallest capture size `G >= B` (1, 2,
  4, 8, then multiples of 16 up to `max_batch_size`), key `(G, G)`. These are captured at start-up.
- Small prefills and mixed batches (at most `max_prefill_tokens` tokens, fewer than `max_prefill_seqs` sequences):
  `T` tokens of `B` sequences are padded to token bucket `Tg` (16, 32, 64, ...) and sequence bucket `Sg > B` (2,
  4, 8); the `Tg - T` pad tokens form one extra sequence and the rest are empty sequences. Captured on first use.
  The gated delta rule runs its token-by-token kernel there (`ModelInputs.use_recurrent_kernel`): the chunked
  kernel reads sequence lengths back to the host, which a capture forbids.

Padding is harmless by construction of the kernels' contracts: pad tokens write no KV (`slot_mapping = -1`), pad
and empty sequences use state row 0 (a reserved dummy no sequence owns), decode padding rows have `kv_len = 0`
(decode attention writes zeros and reads nothing), and every other op is row-wise or per sequence, so whatever the
pad rows compute never reaches a real row.

The first run at a key runs eagerly *through the static buffers*: at start-up on all-padding inputs (it compiles /
autotunes every kernel for exactly the captured shapes and writes nothing a sequence owns), on first use with the
real step itself (capture executes nothing, so the step is not applied twice). Then the graph is captured; later
runs copy their inputs into the buffers and replay. Every capture shares one memory pool; everything runs on the
caller's current stream (the forward stream).

With `routes_shape` (routed experts on for the engine) every graph records the routed experts of its tokens into
one static `[max_tokens, num_moe_layers, top_k]` buffer (`routes_of` reads a batch's rows after a replay); the
MoE layers then do one small copy each, whether or not the batch asked.
"""
from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from ..model_inputs import ModelInputs, StepContext

logger = logging.getLogger('lmdeploy')

PREFILL_TOKEN_BUCKETS = (16, 32, 64, 128, 256)
PREFILL_SEQ_BUCKETS = (2, 4, 8)


def capture_sizes(max_batch_size: int) -> list[int]:
    """Padded decode batch sizes: 1, 2, 4, 8, 16, 32, 48, ... capped by (and including) the maximum."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch_size]
    sizes += list(range(16, max_batch_size, 16))
    return sorted(set(sizes) | {max_batch_size})


class GraphKey(NamedTuple):
    num_tokens: int
    num_seqs: int
    decode: bool


class _StaticInputs:
    """Device buffers the captured graphs read; `view(key)` is the `ModelInputs` of the graph at `key`."""

    def __init__(self, max_tokens: int, max_seqs: int, max_pages: int, device: torch.device,
                 has_lora: bool = False):
        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(*shape, dtype=dtype, device=device)
        self.input_ids = zeros(max_tokens)
        self.position_ids = zeros(max_tokens)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.q_lens = zeros(max_seqs)
        self.kv_lens = zeros(max_seqs)
        self.cu_seqlens_q = zeros(max_seqs + 1)
        self.state_ids = zeros(max_seqs)
        self.is_fresh = zeros(max_seqs, dtype=torch.bool)
        self.block_tables = zeros(max_seqs, max_pages)
        # LoRA slots per sequence (0 = base model) when adapters are loaded: graphs then always run the LoRA op,
        # whose programs exit at once for base rows and padding.
        self.has_lora = has_lora
        self.lora_ids = zeros(max_seqs)
        self.logits_indices = torch.arange(max_tokens, dtype=torch.int64, device=device)
        self._arange = torch.arange(max(max_tokens, max_seqs) + 1, dtype=torch.int64, device=device)
        self.max_pages = max_pages

    def view(self, key: GraphKey) -> ModelInputs:
        t, s = key.num_tokens, key.num_seqs
        return ModelInputs(
            input_ids=self.input_ids[:t], position_ids=self.position_ids[:t], q_lens=self.q_lens[:s],
            kv_lens=self.kv_lens[:s], cu_seqlens_q=self.cu_seqlens_q[:s + 1], block_tables=self.block_tables[:s],
            slot_mapping=self.slot_mapping[:t], logits_indices=self.logits_indices[:t],
            state_ids=self.state_ids[:s], is_fresh=self.is_fresh[:s],
            lora_ids=self.lora_ids[:s] if self.has_lora else None,
            # host copies are shape placeholders here (upper bounds): a graph's kernels read device tensors only
            q_lens_list=[1 if key.decode else t] * s, kv_lens_list=[self.max_pages] * s,
            max_seqlen_q=1 if key.decode else t, max_seqlen_k=t, use_recurrent_kernel=not key.decode)

    def _copy_batch(self, inputs: ModelInputs) -> None:
        t, b = inputs.input_ids.numel(), inputs.batch_size
        width = inputs.block_tables.size(1)
        self.input_ids[:t].copy_(inputs.input_ids, non_blocking=True)
        self.position_ids[:t].copy_(inputs.position_ids, non_blocking=True)
        self.slot_mapping[:t].copy_(inputs.slot_mapping, non_blocking=True)
        self.q_lens[:b].copy_(inputs.q_lens, non_blocking=True)
        self.kv_lens[:b].copy_(inputs.kv_lens, non_blocking=True)
        self.cu_seqlens_q[:b + 1].copy_(inputs.cu_seqlens_q, non_blocking=True)
        self.state_ids[:b].copy_(inputs.state_ids, non_blocking=True)
        self.is_fresh[:b].copy_(inputs.is_fresh, non_blocking=True)
        self.block_tables[:b, :width].copy_(inputs.block_tables, non_blocking=True)
        if inputs.lora_ids is not None:
            self.lora_ids[:b].copy_(inputs.lora_ids, non_blocking=True)
        else:
            self.lora_ids[:b].zero_()

    def _pad_tokens(self, start: int, end: int) -> None:
        if end > start:
            self.input_ids[start:end].zero_()
            self.position_ids[start:end].zero_()
            self.slot_mapping[start:end].fill_(-1)

    def fill_decode(self, inputs: ModelInputs | None, size: int) -> None:
        """Rows [0, B) from a decode batch, rows [B, size) padding (`inputs=None`: all padding)."""
        b = 0
        if inputs is not None:
            b = inputs.batch_size
            self._copy_batch(inputs)
        self._pad_tokens(b, size)
        if size > b:
            self.q_lens[b:size].fill_(1)
            self.cu_seqlens_q[b + 1:size + 1].copy_(self._arange[b + 1:size + 1])
            self.kv_lens[b:size].zero_()
            self.state_ids[b:size].zero_()
            self.is_fresh[b:size].zero_()
            self.lora_ids[b:size].zero_()

    def fill_prefill(self, inputs: ModelInputs | None, key: GraphKey) -> None:
        """Sequences [0, B) from the batch, then one pad sequence holding the pad tokens [T, Tg) (attending to
        itself, on the dummy state row), then empty sequences up to the bucket (`inputs=None`: all padding)."""
        t = b = 0
        if inputs is not None:
            t, b = inputs.input_ids.numel(), inputs.batch_size
            self._copy_batch(inputs)
        tg, sg = key.num_tokens, key.num_seqs
        self._pad_tokens(t, tg)
        self.q_lens[b:sg].zero_()
        self.q_lens[b].fill_(tg - t)
        self.kv_lens[b:sg].zero_()
        self.kv_lens[b].fill_(tg - t)
        self.cu_seqlens_q[b + 1:sg + 1].fill_(tg)
        self.state_ids[b:sg].zero_()
        self.is_fresh[b:sg].fill_(True)
        self.lora_ids[b:sg].zero_()


class CUDAGraphRunner:
    """Runs forwards of `model` through captured CUDA graphs (see the module docstring)."""

    def __init__(self, model: nn.Module, make_context: Callable[[ModelInputs, torch.Tensor | None], StepContext],
                 max_batch_size: int, max_pages: int, device: torch.device,
                 max_prefill_tokens: int = PREFILL_TOKEN_BUCKETS[-1], routes_shape: tuple[int, int] | None = None,
                 has_lora: bool = False):
        self.model = model
        self.make_context = make_context
        self.sizes = capture_sizes(max_batch_size)
        self.max_batch_size = max_batch_size
        self.token_buckets = tuple(t for t in PREFILL_TOKEN_BUCKETS if t <= max_prefill_tokens)
        self.device = device
        max_seqs = max(max_batch_size, PREFILL_SEQ_BUCKETS[-1])
        max_tokens = max((max_batch_size, *self.token_buckets))
        self.static = _StaticInputs(max_tokens, max_seqs, max_pages, device, has_lora=has_lora)
        self.static_routes = None if routes_shape is None else \
            torch.zeros((max_tokens, *routes_shape), dtype=torch.int16, device=device)
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.num_replays = 0
        self.num_prefill_replays = 0

    def padded_size(self, batch_size: int) -> int:
        return next(s for s in self.sizes if s >= batch_size)

    def key_of(self, inputs: ModelInputs) -> GraphKey | None:
        """The graph that can run `inputs`, or None (eager)."""
        if inputs.state_cuts is not None or inputs.block_tables.size(1) > self.static.max_pages:
            return None
        if inputs.mm_token_rows is not None or inputs.mrope_position_ids is not None:
            return None  # image tokens: embeddings and 3-D positions the static buffers do not hold
        num_tokens, num_seqs = inputs.input_ids.numel(), inputs.batch_size
        if num_seqs == 0:
            return None
        if inputs.is_decode and num_tokens == num_seqs:
            if num_seqs > self.max_batch_size:
                return None
            size = self.padded_size(num_seqs)
            return GraphKey(size, size, True)
        if not self.token_buckets:
            return None
        tokens = next((t for t in self.token_buckets if t >= num_tokens), None)
        seqs = next((s for s in PREFILL_SEQ_BUCKETS if s > num_seqs), None)
        if tokens is None or seqs is None:
            return None
        return GraphKey(tokens, seqs, False)

    def supports(self, inputs: ModelInputs) -> bool:
        return self.key_of(inputs) is not None

    def _context(self, static_inputs: ModelInputs) -> StepContext:
        routes = None if self.static_routes is None else self.static_routes[:static_inputs.input_ids.numel()]
        return self.make_context(static_inputs, routes)

    def routes_of(self, inputs: ModelInputs) -> torch.Tensor:
        """The routed experts of the batch `run` last ran (rows of its real tokens; valid until the next run)."""
        if self.static_routes is None:
            raise ValueError('routed experts were asked for, but the graphs were captured without recording them')
        return self.static_routes[:inputs.input_ids.numel()]

    def run(self, inputs: ModelInputs, key: GraphKey | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] of the batch (`supports(inputs)` must hold; `key`: its `key_of`, if known)."""
        key = key or self.key_of(inputs)
        self._fill(inputs, key)
        num_tokens = inputs.input_ids.numel()
        entry = self.graphs.get(key)
        if entry is None:
            static_inputs = self.static.view(key)
            out = self.model(self._context(static_inputs))  # the real step, eager, on the captured shapes
            self._capture(key, static_inputs)
            return out[:num_tokens]
        graph, out = entry
        graph.replay()
        self.num_replays += 1
        self.num_prefill_replays += not key.decode
        return out[:num_tokens]

    def _fill(self, inputs: ModelInputs | None, key: GraphKey) -> None:
        if key.decode:
            self.static.fill_decode(inputs, key.num_seqs)
        else:
            self.static.fill_prefill(inputs, key)

    def capture_all(self) -> None:
        """Capture every decode size up front, largest first (so smaller graphs reuse its pool memory). Each
        warm-up run is all padding, so it writes nothing any sequence owns: no KV (slot -1), only the dummy state
        row."""
        for size in reversed(self.sizes):
            key = GraphKey(size, size, True)
            if key not in self.graphs:
                self._fill(None, key)
                static_inputs = self.static.view(key)
                self.model(self._context(static_inputs))  # compile / autotune for exactly these shapes
                self._capture(key, static_inputs)

    def _capture(self, key: GraphKey, static_inputs: ModelInputs) -> None:
        stream = torch.cuda.current_stream(self.device)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        # No garbage collection during the capture: a collected CUDAGraph (another engine's, left in a reference
        # cycle) resets itself in its destructor, which is not permitted while a stream captures and invalidates this
        # capture (seen on the H200: "operation not permitted when stream is capturing (function reset)").
        # `torch.cuda.graph` collects once before it begins.
        gc_enabled = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode='thread_local'):
                out = self.model(self._context(static_inputs))
        finally:
            if gc_enabled:
                gc.enable()
        self.graphs[key] = (graph, out)
        logger.info('captured a CUDA graph for %s', key)
