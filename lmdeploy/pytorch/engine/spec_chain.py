"""The greedy draft chain of a speculative (MTP) step in one CUDA graph per padded batch size.

Owns its static buffers and graphs; never touches scheduler state. Used by `SpeculativeDecoder.draft` (through
`ModelAgent`) when every drafting sequence is greedy, on CUDA unless `eager_mode`; on by default since H200 run 7
(2026-12-01: the gpu tests of `tests/engine/test_mtp_graphs.py` and `benchmark/bench_mtp_engine.py`, see
`docs/benchmarks.md`), off with `LMDEPLOY_SPEC_CHAIN_GRAPH=0`. The same switch governs the packed uploads of
speculative steps (`packed_upload`). Sampled drafts (they need the head's distributions), batches no graph fits and
the switch at `0` take the step-by-step path through `HeadGraphs`.

One replay computes what the step-by-step greedy chain computes: from the head's hidden state at each sequence's
last catch-up row (`prev`), K rounds of `lm_head` + argmax, and between two rounds one head step at the next
position (chained step s = 1 .. K - 1 sits at position `num_computed + s - 1`, reads the previous round's draft and
the previous head output, writes the head's KV there). The host gives chained step 1's rows only
(`plan_chain(seqs, 1, ...)`: positions and block tables); every later step's positions, KV slots and lengths follow
on the device from those (slot = page of the row's table * kernel_block_size + offset, as `plan_chain` computes
them), and its tokens are the previous round's argmax. Padding rows (a batch of D padded to G) carry slot -1 and
kv_len 0 (decode padding: they write no KV and read none), token 0, position 0, the dummy state row; every op is
row-wise, so they never reach a real row. Without a captured graph (CPU tests) `run` computes the same chain
eagerly on the same static buffers, with the real host lengths the default backend reads.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch

from ..model_inputs import ModelInputs
from .cuda_graph import capture_sizes
from .spec_graphs import capture_graph
from .static_inputs import GraphKey, StaticInputs

logger = logging.getLogger('lmdeploy')


def chain_graph_enabled() -> bool:
    """The greedy chain graph and the packed uploads of speculative steps (see the module docstring), unless
    `LMDEPLOY_SPEC_CHAIN_GRAPH=0`."""
    return os.environ.get('LMDEPLOY_SPEC_CHAIN_GRAPH', '1') != '0'


class DraftChainGraphs:
    """Greedy drafts [D, K] of a chain through one replay (see the module docstring); `size_of` says whether one
    fits."""

    def __init__(self, model, make_context, max_batch_size: int, max_pages: int, num_draft_tokens: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device, kernel_block_size: int = 1):
        self.model, self.make_context, self.k, self.device = model, make_context, num_draft_tokens, device
        self.kbs, self.max_batch_size = kernel_block_size, max_batch_size
        self.sizes = capture_sizes(max_batch_size)
        self.static = StaticInputs(max_batch_size, max_batch_size, max_pages, device,
                                    kernel_block_size=kernel_block_size)
        self.prev = torch.zeros(max_batch_size, hidden_size, dtype=dtype, device=device)
        self.base = torch.zeros(max_batch_size, dtype=torch.int64, device=device)  # chained step 1's positions
        self.valid = torch.zeros(max_batch_size, dtype=torch.bool, device=device)

        def step_buffers() -> dict[str, torch.Tensor]:
            return dict(input_ids=torch.zeros_like(self.base), position_ids=torch.zeros_like(self.base),
                        slot_mapping=torch.full_like(self.base, -1), kv_lens=torch.zeros_like(self.base))
        self.steps = [step_buffers() for _ in range(max(0, num_draft_tokens - 1))]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.num_replays = 0
        self.capture_seconds = 0.0

    def size_of(self, batch: int, table_width: int) -> int | None:
        """The padded batch size of the graph for `batch` drafting sequences with block tables `table_width` pages
        wide, or None (the step-by-step path)."""
        if batch == 0 or batch > self.max_batch_size or table_width > self.static.max_pages:
            return None
        return next(s for s in self.sizes if s >= batch)

    def fill(self, prev: torch.Tensor | None, inputs: ModelInputs | None, size: int) -> None:
        """Rows [0, D) from the drafting sequences (`prev` [D, H], chained step 1's `inputs`), rows [D, size)
        padding (`inputs=None`: all padding)."""
        s, b = self.static, 0
        if inputs is not None:
            b = inputs.batch_size
            self.prev[:b].copy_(prev)
            self.base[:b].copy_(inputs.position_ids, non_blocking=True)
            s.block_tables[:b, :inputs.block_tables.size(1)].copy_(inputs.block_tables, non_blocking=True)
            self.valid[:b].fill_(True)
        s.q_lens[:size].fill_(1)
        s.cu_seqlens_q[:size + 1].copy_(s._arange[:size + 1])
        s.state_ids[:size].zero_()
        s.is_fresh[:size].zero_()
        if size > b:
            self.base[b:size].zero_()
            self.valid[b:size].fill_(False)

    def view(self, size: int, step: int, kv_lens_list: list[int] | None = None) -> ModelInputs:
        """Chained step `step`'s inputs at `size` (the decode graph's view with this step's buffers); `kv_lens_list`:
        real host lengths for an eager run (a graph's kernels read device tensors only)."""
        buffers = {name: t[:size] for name, t in self.steps[step - 1].items()}
        view = dataclasses.replace(self.static.view(GraphKey(size, size, True)), **buffers)
        if kv_lens_list is not None:
            view = dataclasses.replace(view, kv_lens_list=kv_lens_list, max_seqlen_k=max(kv_lens_list),
                                       host_lens_exact=True)
        return view

    def _step_inputs(self, size: int, step: int, tokens: torch.Tensor) -> None:
        """Chained step `step`'s tokens, positions, KV slots and lengths, on the device."""
        buffers, valid = self.steps[step - 1], self.valid[:size]
        pos = self.base[:size] + (step - 1)
        table = self.static.block_tables[:size]
        page = table.gather(1, (pos // self.kbs).clamp(max=table.size(1) - 1)[:, None])[:, 0]
        buffers['input_ids'][:size].copy_(torch.where(valid, tokens, 0))
        buffers['position_ids'][:size].copy_(torch.where(valid, pos, 0))
        buffers['slot_mapping'][:size].copy_(torch.where(valid, page * self.kbs + pos % self.kbs, -1))
        buffers['kv_lens'][:size].copy_(torch.where(valid, pos + 1, 0))

    def _chain(self, size: int, host_lens: list[list[int]] | None = None) -> torch.Tensor:
        """Drafts [size, K]: round s is argmax(lm_head(h)); between rounds, one head step."""
        hidden, drafts = self.prev[:size], []
        for step in range(self.k):
            if step:
                self._step_inputs(size, step, drafts[-1])
                view = self.view(size, step, host_lens[step - 1] if host_lens is not None else None)
                hidden = self.model.draft_hidden(hidden, self.make_context(view))
            drafts.append(self.model.compute_logits(hidden).argmax(dim=-1))
        return torch.stack(drafts, dim=1)

    def run(self, prev: torch.Tensor, inputs: ModelInputs) -> torch.Tensor | None:
        """Greedy drafts [D, K] on the device after the head's hidden states `prev` [D, H] at each drafting
        sequence's last catch-up row; `inputs`: chained step 1's rows (`plan_chain(seqs, 1, ...)`, on the device).
        None when no graph fits."""
        batch = inputs.batch_size
        size = self.size_of(batch, inputs.block_tables.size(1))
        if size is None:
            return None
        self.fill(prev, inputs, size)
        entry = self.graphs.get(size)
        if entry is None:  # not captured (the CPU tests): the same chain on the static buffers, eagerly
            lens = [[kv + step - 1 for kv in inputs.kv_lens_list] + [0] * (size - batch) for step in range(1, self.k)]
            return self._chain(size, lens)[:batch]
        graph, out = entry
        graph.replay()
        self.num_replays += 1
        return out[:batch]

    def capture_all(self) -> None:
        """Capture every padded batch size, largest first, each after one eager run on all-padding inputs (compile /
        autotune for that shape; padding writes no KV)."""
        start = time.perf_counter()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self.fill(None, None, size)
            self._chain(size)
            self.graphs[size] = capture_graph(lambda size=size: self._chain(size), self.pool, self.device)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        logger.info('CUDA graphs of the greedy draft chain (K = %d): %d sizes captured in %.2f s', self.k,
                    len(self.graphs), self.capture_seconds)


def build_chain_graphs(model, make_context, cache_engine, max_batch_size: int, max_pages: int,
                       num_draft_tokens: int, device: torch.device) -> DraftChainGraphs | None:
    """The chain graphs of a speculative engine with graphs (None: K < 2, nothing to chain, or switched off)."""
    if num_draft_tokens < 2 or not chain_graph_enabled():
        return None
    cfg = cache_engine.model_config
    return DraftChainGraphs(model, make_context, max_batch_size, max_pages, num_draft_tokens, cfg.hidden_size,
                            getattr(torch, cfg.dtype), device,
                            kernel_block_size=cache_engine.cache_config.kernel_block_size)
