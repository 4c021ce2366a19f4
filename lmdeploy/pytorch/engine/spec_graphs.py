"""CUDA graphs of the speculative (MTP) steps: the verify forward of K drafts per sequence and the draft head.

Owns: the static buffers and captured graphs of both; never touches scheduler state. Used by `ModelAgent` on CUDA
unless `eager_mode`; everything runs on the caller's current stream (the forward stream), captured at start-up
(`capture_all`) by padded batch size (`cuda_graph.capture_sizes`; K is fixed per engine).

- `VerifyGraphRunner`: the target's pre-norm hidden states of a *uniform* verify forward, where every sequence
  feeds exactly K + 1 tokens with a state cut after each draft position (`ModelInputs.draft_state_slots`, the
  shape-only cuts of `nn.draft_cuts`). A batch of B sequences is padded to G >= B: pad sequences feed K + 1 tokens
  that write no KV (slot -1), attend to themselves on page 0, start fresh on the dummy state row 0 and cut into
  it, so nothing they compute reaches a real row or a row any sequence owns. Other verify forwards (rows with
  fewer drafts, prefill pieces, in-prefill checkpoints) run eagerly.
- `HeadGraphs`: the draft head's forwards, through a `CUDAGraphRunner` of its own over a model function that reads
  the previous hidden states from a static buffer: chained drafts taken step by step (sampled chains, batches no
  chain graph fits, and every chain with `LMDEPLOY_SPEC_CHAIN_GRAPH=0`; greedy chains otherwise replay
  `spec_chain.DraftChainGraphs` at once) are decode batches (one row per sequence), the catch-up over the
  committed positions is a prefill-shaped forward (token and sequence buckets, captured on first use beyond the
  warm keys). The head is full attention only, so its graphs hold no state row.

The first capture at a shape runs eagerly on all-padding inputs first (compile / autotune for exactly that
shape); a replay copies the batch into the static buffers and replays. Graph replay computes what the eager
forward computes with the same kernels on the same shapes (the gpu tests check tokens and logits).
"""
from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

import torch

from ..model_inputs import ModelInputs, StepContext
from .cuda_graph import CUDAGraphRunner, capture_sizes, prefill_key
from .static_inputs import StaticInputs

logger = logging.getLogger('lmdeploy')


def capture_graph(fn: Callable[[], torch.Tensor], pool, device: torch.device) -> tuple[torch.cuda.CUDAGraph,
                                                                                      torch.Tensor]:
    """Capture `fn()` on the current stream into `pool`, garbage collection off (see `CUDAGraphRunner._capture`)."""
    graph = torch.cuda.CUDAGraph()
    gc_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=torch.cuda.current_stream(device),
                              capture_error_mode='thread_local'):
            out = fn()
    finally:
        if gc_enabled:
            gc.enable()
    return graph, out


def build_spec_graphs(model, make_context, cache_engine, max_batch_size: int, max_pages: int, num_draft_tokens: int,
                      device: torch.device, has_lora: bool) -> tuple[VerifyGraphRunner, HeadGraphs]:
    """The verify and head graph runners of a speculative engine (captured by `capture_all`)."""
    cfg, kbs = cache_engine.model_config, cache_engine.cache_config.kernel_block_size
    verify = VerifyGraphRunner(model.pre_norm_hidden, make_context, max_batch_size, max_pages, num_draft_tokens,
                               device, has_lora=has_lora, kernel_block_size=kbs)
    head = HeadGraphs(model, make_context, max_batch_size, max_pages, num_draft_tokens, cfg.hidden_size,
                      getattr(torch, cfg.dtype), device, kernel_block_size=kbs)
    return verify, head


class VerifyGraphRunner:
    """Replays uniform verify forwards (see the module docstring); `size_of(inputs)` says whether one fits."""

    def __init__(self, forward_pre: Callable[[StepContext], torch.Tensor],
                 make_context: Callable[[ModelInputs], StepContext], max_batch_size: int, max_pages: int,
                 num_draft_tokens: int, device: torch.device, has_lora: bool = False, kernel_block_size: int = 1):
        self.forward_pre, self.make_context = forward_pre, make_context
        self.k, self.rows = num_draft_tokens, num_draft_tokens + 1
        self.sizes = capture_sizes(max_batch_size)
        self.max_batch_size, self.max_pages, self.device = max_batch_size, max_pages, device
        self.static = StaticInputs(max_batch_size * self.rows, max_batch_size, max_pages, device, has_lora=has_lora,
                                    kernel_block_size=kernel_block_size)
        self.draft_slots = torch.zeros(max_batch_size, self.k, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.num_replays = 0
        self.capture_seconds = 0.0

    def size_of(self, inputs: ModelInputs) -> int | None:
        """The padded batch size of the graph that runs `inputs`, or None (eager)."""
        slots = inputs.draft_state_slots
        if slots is None or slots.shape[1] != self.k or inputs.state_cuts is not None:
            return None
        batch = slots.shape[0]
        if batch == 0 or batch > self.max_batch_size or inputs.input_ids.numel() != batch * self.rows:
            return None
        if inputs.block_tables.size(1) > self.max_pages or inputs.mm_token_rows is not None \
                or inputs.mrope_position_ids is not None or inputs.record_routed_experts:
            return None
        return next(s for s in self.sizes if s >= batch)

    def view(self, size: int, kv_lens_list: list[int] | None = None) -> ModelInputs:
        """The graph's inputs at `size`; `kv_lens_list`: the real host lengths of the filled rows, for an eager run
        on backends that read them (a graph's kernels read device tensors only: the default is a placeholder)."""
        s, t = self.static, size * self.rows
        kv_lens_list = [self.max_pages] * size if kv_lens_list is None else kv_lens_list
        return ModelInputs(
            input_ids=s.input_ids[:t], position_ids=s.position_ids[:t], q_lens=s.q_lens[:size],
            kv_lens=s.kv_lens[:size], cu_seqlens_q=s.cu_seqlens_q[:size + 1], block_tables=s.block_tables[:size],
            slot_mapping=s.slot_mapping[:t], logits_indices=s.logits_indices[:t], state_ids=s.state_ids[:size],
            is_fresh=s.is_fresh[:size], lora_ids=s.lora_ids[:size] if s.has_lora else None,
            q_lens_list=[self.rows] * size, kv_lens_list=kv_lens_list, max_seqlen_q=self.rows,
            max_seqlen_k=max(kv_lens_list), draft_state_slots=self.draft_slots[:size])

    def fill(self, inputs: ModelInputs | None, size: int) -> None:
        """Rows [0, B) from the verify batch, rows [B, size) padding (`inputs=None`: all padding)."""
        s, b = self.static, 0
        if inputs is not None:
            b = inputs.draft_state_slots.shape[0]
            s._copy_batch(inputs)
            self.draft_slots[:b].copy_(inputs.draft_state_slots, non_blocking=True)
        s._pad_tokens(b * self.rows, size * self.rows)
        if size > b:
            s.q_lens[b:size].fill_(self.rows)
            s.kv_lens[b:size].fill_(self.rows)
            s.cu_seqlens_q[b + 1:size + 1].copy_(s._arange[b + 1:size + 1] * self.rows)
            s.state_ids[b:size].zero_()
            s.is_fresh[b:size].fill_(True)
            s.lora_ids[b:size].zero_()
            s.block_tables[b:size].zero_()  # pad rows read their K + 1 keys from page 0
            self.draft_slots[b:size].zero_()

    def run(self, inputs: ModelInputs, size: int) -> torch.Tensor:
        """Pre-norm hidden states [T, H] of the verify batch (`size = size_of(inputs)`)."""
        self.fill(inputs, size)
        num_tokens = inputs.input_ids.numel()
        entry = self.graphs.get(size)
        if entry is None:  # not captured (the CPU tests of the padding): the same forward on the static buffers
            lens = inputs.kv_lens_list + [self.rows] * (size - len(inputs.kv_lens_list))
            return self.forward_pre(self.make_context(self.view(size, lens)))[:num_tokens]
        graph, out = entry
        graph.replay()
        self.num_replays += 1
        return out[:num_tokens]

    def capture_all(self) -> None:
        """Capture every padded batch size, largest first (smaller graphs reuse its pool memory); each warm-up
        run is all padding, so it writes no KV and only the dummy state row."""
        start = time.perf_counter()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self.fill(None, size)
            self.forward_pre(self.make_context(self.view(size)))  # compile / autotune for exactly this shape
            ctx = self.make_context(self.view(size))  # a fresh view: no per-forward memo of the warm-up is captured
            self.graphs[size] = capture_graph(lambda ctx=ctx: self.forward_pre(ctx), self.pool, self.device)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        logger.info('CUDA graphs of the verify forward (K = %d): %d sizes captured in %.2f s', self.k,
                    len(self.graphs), self.capture_seconds)


class HeadGraphs:
    """The draft head's forwards through CUDA graphs (see the module docstring); `run` gives None where no graph
    fits (the caller runs the head eagerly)."""

    def __init__(self, model, make_context: Callable[[ModelInputs, torch.Tensor | None], StepContext],
                 max_batch_size: int, max_pages: int, num_draft_tokens: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, kernel_block_size: int = 1):
        self.model, self.k, self.device = model, num_draft_tokens, device
        # the catch-up feeds up to K + 1 committed positions per sequence, plus the position before a cache hit
        self.runner = CUDAGraphRunner(self._forward, make_context, max_batch_size, max_pages, device,
                                      max_prefill_tokens=max_batch_size * (num_draft_tokens + 2),
                                      kernel_block_size=kernel_block_size)
        self.prev = torch.zeros(self.runner.static.input_ids.numel(), hidden_size, dtype=dtype, device=device)

    def _forward(self, ctx: StepContext) -> torch.Tensor:
        return self.model.draft_hidden(self.prev[:ctx.inputs.input_ids.numel()], ctx)

    def run(self, prev: torch.Tensor, inputs: ModelInputs) -> torch.Tensor | None:
        """The head's normed hidden states [T, H] for `inputs` after the previous hidden states `prev` [T, H]."""
        key = self.runner.key_of(inputs)
        if key is None:
            return None
        self.prev[:prev.size(0)].copy_(prev)
        return self.runner.run(inputs, key)

    def capture_all(self) -> None:
        """The runner's start-up graphs, then the catch-up shapes of steady decoding: every padded batch size B
        with 1 .. K + 2 rows per sequence (accepted runs, plus the row before a cache hit), so no step in steady
        decoding captures a graph."""
        runner = self.runner
        runner.capture_all()
        keys = {prefill_key(size * rows, size, runner.token_buckets, runner.seq_buckets)
                for size in runner.sizes for rows in range(2, self.k + 3)}
        for key in sorted((k for k in keys if k is not None), reverse=True):
            if key in runner.graphs or key in runner.failed:
                continue
            try:
                runner._warm_and_capture(key)
            except Exception as exc:  # noqa: BLE001 - a shape that cannot run here stays eager
                runner.failed.add(key)
                torch.cuda.synchronize(self.device)
                logger.warning('warming up a draft-head CUDA graph for %s failed (%s: %s); that shape runs eagerly',
                               key, type(exc).__name__, exc)
