"""Runs one forward on the device: copies inputs over, runs the cache copies and the model, samples.

Owns the model and the device side of a step. Order inside `forward`, all on the forward stream: inputs to
device -> KV restore copies -> state restore copies -> model forward -> logits of the sampled rows -> sampling ->
the sampled ids' copy to the host -> KV save copies -> state save copies (the saves read only the caches, so the
tokens need not wait for them). It never touches scheduler state.

Routed experts: a forward whose inputs ask (`ModelInputs.record_routed_experts`) gets a `[T, num_moe_layers,
top_k]` record that the MoE layers fill; it comes back on the host as uint16 in `ForwardOutput.routed_experts`.
CUDA graphs captured with `record_routed_experts` on (the engine flag) always record into a static buffer (a
`[T, top_k]` copy per MoE layer); a forward that did not ask skips the host copy.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from ..backends.base import Backend, OpType
from ..model_inputs import ModelInputs, SamplingInputs, StepContext
from ..nn.blocked_fp8 import fp8_linear_shapes
from ..nn.moe import SparseMoeBlock
from .async_scheduling import DeviceTokens, TokenFeed
from .cache_engine import CacheEngine
from .cache_inputs import CacheCheckpointInputs
from .cuda_graph import CUDAGraphRunner, prefill_graph_tokens
from .device_streams import DeviceStreams
from .packed_upload import packable, packed_uploads_enabled, upload_packed
from .spec_chain import DraftChainGraphs, build_chain_graphs, chain_graph_enabled
from .spec_decode import PendingDrafts, SampleParams, SpeculativeDecoder, VerifyOutput
from .spec_graphs import HeadGraphs, VerifyGraphRunner, build_spec_graphs
from .spec_inputs import HeadPlan, VerifyPlan
from .static_inputs import graph_staging_enabled
from .trace import phase
from .vision_cache import VisionEncoderCache
from .warm_start import padding_inputs, warm_up_plan, warm_up_sampling

logger = logging.getLogger('lmdeploy')


class ForwardOutput:
    __slots__ = ('next_token_ids', 'logprobs', 'logits', 'routed_experts', 'sampled_ids')

    def __init__(self, next_token_ids: list[int] | None, logprobs: list[dict[int, float]] | None,
                 logits: torch.Tensor | None = None, routed_experts: np.ndarray | None = None,
                 sampled_ids: DeviceTokens | None = None):
        # The sampled ids on the host; None for a deferred forward until `resolve()` waits for them.
        self.next_token_ids = next_token_ids
        # A deferred forward's sampled ids (device tensor + pending host copy), async scheduling.
        self.sampled_ids = sampled_ids
        self.logprobs = logprobs
        # Logits of the sampled rows (float32, on the device), for callers that keep them.
        self.logits = logits
        # [T, num_moe_layers, top_k] uint16 on the host: the experts each fed token was routed to (row order of the
        # packed batch), or None when the forward did not record them.
        self.routed_experts = routed_experts

    def resolve(self) -> list[int]:
        """The sampled ids on the host (waits for a deferred forward's copy)."""
        if self.next_token_ids is None:
            self.next_token_ids = self.sampled_ids.tolist()
        return self.next_token_ids


class ModelAgent:

    def __init__(self, model: nn.Module, cache_engine: CacheEngine, backend: Backend, device: torch.device,
                 cuda_graph_batch_size: int = 0, max_pages_per_seq: int = 0, record_routed_experts: bool = False,
                 has_lora: bool = False, vision_cache_bytes: int = 0, max_prefill_tokens: int = 8192,
                 max_batch_size: int = 1, num_draft_tokens: int = 0):
        """`cuda_graph_batch_size > 0` (CUDA only) replays decode batches of up to that many sequences through
        captured CUDA graphs whose block tables hold `max_pages_per_seq` kernel pages per sequence, and prefills /
        mixed batches of up to `max_prefill_tokens` prompt tokens plus a decode batch, within the largest prefill
        graph (`prefill_graph_tokens`).
        `record_routed_experts` (the engine flag) lets forwards record routed experts; graphs then always do.
        `has_lora`: the model has LoRA adapters attached (graphs then carry each row's adapter slot).
        `vision_cache_bytes > 0` keeps encoded images by content hash (`VisionEncoderCache`).
        `num_draft_tokens > 0`: MTP speculative decoding with K drafts (`forward_verify`, `draft`); with graphs,
        every graph of the target keeps its pre-norm hidden states (the head reads them) and the verify forward and
        the head replay graphs of their own (`spec_graphs`), the greedy draft chain one graph (`spec_chain`)."""
        self.model = model
        self.vision_cache = VisionEncoderCache(vision_cache_bytes) if vision_cache_bytes > 0 else None
        self.cache_engine = cache_engine
        self.device = device
        cfg = cache_engine.model_config
        self.routes_shape = (cfg.num_moe_layers, cfg.moe_top_k) \
            if record_routed_experts and cfg.num_moe_layers else None
        self._sample = backend.build(OpType.Sampling)
        self.streams = DeviceStreams(device)
        self.graph_runner = None
        self.num_eager_forwards = 0  # forwards no CUDA graph ran (`forward_counts`)
        self.spec: SpeculativeDecoder | None = None
        # the eager warm-up's bounds: the largest forward the scheduler makes, and the most sequences in one
        self.max_forward_tokens = max(max_prefill_tokens, max_batch_size)
        self.max_batch_size = max_batch_size
        self.has_lora = has_lora
        self.verify_graphs: VerifyGraphRunner | None = None
        self.head_graphs: HeadGraphs | None = None
        self.chain_graphs: DraftChainGraphs | None = None
        self._packed_uploads = chain_graph_enabled()
        self._plain_packed_uploads = packed_uploads_enabled()
        self._staged_uploads = graph_staging_enabled()
        if num_draft_tokens:
            self.enable_speculative(num_draft_tokens)
        # with speculation the target's graphs end before the final norm (`spec.verify` / `run_model` apply it)
        self._graphs_pre_norm = bool(num_draft_tokens)
        target = model.pre_norm_hidden if num_draft_tokens else model
        if cuda_graph_batch_size > 0 and device.type == 'cuda':
            from ..backends.cuda import graph_gdr_chunked, prefill_graphs_supported
            cfg = cache_engine.model_config
            prefill_tokens = prefill_graph_tokens(max_prefill_tokens + cuda_graph_batch_size) \
                if prefill_graphs_supported(getattr(torch, cfg.dtype), cfg.is_hybrid) else 0
            self.graph_runner = CUDAGraphRunner(target, self._context, cuda_graph_batch_size, max_pages_per_seq,
                                                device, max_prefill_tokens=prefill_tokens,
                                                routes_shape=self.routes_shape, has_lora=has_lora,
                                                chunk_indices=cfg.is_hybrid and graph_gdr_chunked(),
                                                kernel_block_size=cache_engine.cache_config.kernel_block_size)
            if num_draft_tokens:
                self.verify_graphs, self.head_graphs = build_spec_graphs(
                    model, self._context, cache_engine, cuda_graph_batch_size, max_pages_per_seq, num_draft_tokens,
                    device, has_lora)
                self.chain_graphs = build_chain_graphs(model, self._context, cache_engine, cuda_graph_batch_size,
                                                       max_pages_per_seq, num_draft_tokens, device)

    def enable_speculative(self, num_draft_tokens: int) -> None:
        """Verify and draft with the model's MTP head (`forward_verify`, `draft`); graphs of the speculative steps
        need `num_draft_tokens` at construction. Idempotent for the same K."""
        if self.spec is None or self.spec.k != num_draft_tokens:
            self.spec = SpeculativeDecoder(self.model, self.cache_engine, self._sample, num_draft_tokens)

    def _target_hidden(self, inputs: ModelInputs) -> torch.Tensor:
        """The target's pre-norm hidden states of a speculative step: a verify graph for a uniform verify
        forward, a graph of the target's runner for the others it supports, else eager."""
        if self.verify_graphs is not None:
            size = self.verify_graphs.size_of(inputs)
            if size is not None:
                return self.verify_graphs.run(inputs, size)
        if self.graph_runner is not None and inputs.draft_state_slots is None:
            key = self.graph_runner.key_of(inputs)
            if key is not None:
                return self.graph_runner.run(inputs, key)
        return self.model.pre_norm_hidden(self._context(inputs))

    def _head_hidden(self, prev: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
        """The draft head's normed hidden states: through its graphs where one fits, else eager."""
        out = self.head_graphs.run(prev, inputs) if self.head_graphs is not None else None
        return out if out is not None else self.model.draft_hidden(prev, self._context(inputs))

    def _context(self, inputs: ModelInputs, routed_experts: torch.Tensor | None = None) -> StepContext:
        return StepContext(inputs=inputs, kv_caches=self.cache_engine.kv_caches,
                           state_caches=self.cache_engine.state_caches,
                           kernel_block_size=self.cache_engine.cache_config.kernel_block_size,
                           routed_experts=routed_experts)

    def restore(self, cache_inputs: CacheCheckpointInputs | None) -> None:
        if cache_inputs is None:
            return
        if cache_inputs.kv_restore_plan is not None:
            self.cache_engine.copy_logical_blocks(cache_inputs.kv_restore_plan)
        if cache_inputs.state_restore_plan is not None:
            self.cache_engine.copy_state_slots(cache_inputs.state_restore_plan)

    def save(self, cache_inputs: CacheCheckpointInputs | None) -> None:
        if cache_inputs is None:
            return
        if cache_inputs.kv_save_plan is not None:
            self.cache_engine.copy_logical_blocks(cache_inputs.kv_save_plan)
        if cache_inputs.state_save_plan is not None:
            self.cache_engine.copy_state_slots(cache_inputs.state_save_plan)

    def embed_images(self, inputs: ModelInputs) -> None:
        """Fill `inputs.mm_embeds` for the forward's images: encoder-cache hits are reused, the misses run through
        the vision tower in one packed call (on the forward stream) and are cached."""
        items = inputs.vision_items
        if not items:
            return
        embeds: dict[int, torch.Tensor] = {}
        for item in items:
            if item.content_hash not in embeds:
                cached = self.vision_cache.get(item.content_hash) if self.vision_cache is not None else None
                if cached is not None:
                    embeds[item.content_hash] = cached
        misses = list({item.content_hash: item for item in items if item.content_hash not in embeds}.values())
        if misses:
            pixels = torch.cat([m.pixels.pixel_values for m in misses]).to(self.device, non_blocking=True)
            out = self.model.encode_images(pixels, [m.pixels.grid_thw for m in misses])
            sizes = [self.model.num_image_tokens(m.pixels.grid_thw) for m in misses]
            for item, part in zip(misses, out.split(sizes)):
                embeds[item.content_hash] = part
                if self.vision_cache is not None:
                    self.vision_cache.put(item.content_hash, part)
        inputs.mm_embeds = torch.cat([embeds[i.content_hash][i.first_token:i.first_token + i.num_tokens]
                                      for i in items])

    def run_model(self, inputs: ModelInputs, cache_inputs: CacheCheckpointInputs | None, save: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """restore copies -> image embeddings -> model -> save copies (`save=False`: the caller queues them, after
        its sampling); returns the hidden states and the routed-experts record (None unless the inputs asked for
        it)."""
        with phase('restore'):
            self.restore(cache_inputs)
        self.embed_images(inputs)
        key = self.graph_runner.key_of(inputs) if self.graph_runner is not None else None
        routes = None
        if key is not None:
            with phase('graph'):
                hidden = self.graph_runner.run(inputs, key)
            if self._graphs_pre_norm:
                hidden = self.model.final_norm(hidden)
            if inputs.record_routed_experts:
                routes = self.graph_runner.routes_of(inputs)
        else:
            self.num_eager_forwards += 1
            if inputs.record_routed_experts and self.routes_shape is None:
                raise ValueError('routed experts were asked for, but the engine does not record them '
                                 '(enable_return_routed_experts is off, or the model has no MoE layer)')
            if inputs.record_routed_experts:
                routes = torch.empty((inputs.input_ids.numel(), *self.routes_shape), dtype=torch.int16,
                                     device=self.device)
            with phase('eager'):
                hidden = self.model(self._context(inputs, routes))
        if save:
            with phase('save'):
                self.save(cache_inputs)
        return hidden, routes

    def forward_counts(self) -> dict:
        """How the model forwards ran since start-up (the warm-up excluded): `eager` (no graph fits: larger forwards,
        in-prefill state cuts, images, full graph budget), `graph_replays`, and `graph_first_uses` with their host
        seconds (a key first met by a request: that step ran eagerly, then captured it). A benchmark reads the
        difference over a run."""
        runner = self.graph_runner
        return {'eager': self.num_eager_forwards, 'graph_replays': 0 if runner is None else runner.num_replays,
                'graph_first_uses': 0 if runner is None else runner.num_first_uses,
                'graph_first_use_s': 0.0 if runner is None else runner.first_use_seconds}

    @torch.inference_mode()
    def tune_kernels(self, max_tokens: int) -> None:
        """Before any graph is captured or request served (CUDA only), so that no forward pays for tuning: autotune
        the FP8 GEMM tiles for the model's FP8 linears and every row bucket up to `max_tokens`, and compile every
        tile config the fused MoE can pick (its tuned table, the shared expert folded in or not; block-wise FP8
        experts: every row block and alignment launch) for forwards up to `max_tokens` tokens."""
        if self.device.type != 'cuda':
            return
        from ..backends.cuda import tune_fp8_gemms, warm_up_fp8_moe_tiles, warm_up_moe_tiles
        shapes = fp8_linear_shapes(self.model)
        if shapes:
            began = time.perf_counter()
            keys = tune_fp8_gemms(shapes, max_tokens, getattr(torch, self.cache_engine.model_config.dtype),
                                  self.device)
            logger.info('FP8 GEMM autotuning: %d keys (%d shapes) in %.1f s', keys, len(shapes),
                        time.perf_counter() - began)
        began, calls, seen = time.perf_counter(), 0, set()
        for block in self.model.modules():
            experts = getattr(block, 'experts', None)
            if not isinstance(block, SparseMoeBlock):
                continue
            if experts.weight_block_size is not None:   # block-wise FP8 experts: their kernels' binaries
                key = (tuple(experts.gate_up_proj.shape), 'fp8', experts.weight_block_size, block.gate.top_k)
                if key not in seen:
                    seen.add(key)
                    calls += warm_up_fp8_moe_tiles(
                        experts.gate_up_proj, experts.down_proj, experts.gate_up_proj_scale_inv,
                        experts.down_proj_scale_inv, experts.weight_block_size, block.gate.top_k, max_tokens,
                        getattr(torch, self.cache_engine.model_config.dtype))
                continue
            shared = block.foldable_shared(1)
            key = (tuple(experts.gate_up_proj.shape), experts.gate_up_proj.dtype, block.gate.top_k, shared is None)
            if key not in seen:
                seen.add(key)
                calls += warm_up_moe_tiles(experts.gate_up_proj, experts.down_proj, block.gate.top_k, max_tokens,
                                           shared, block.fold_max_tokens())
        if calls:
            logger.info('fused MoE tile warm-up: %d calls in %.1f s', calls, time.perf_counter() - began)

    def capture_cuda_graphs(self) -> None:
        """Warm start (CUDA): the eager warm-up (`warm_start.py`), then the graphs of every decode size and prefill
        warm key (`CUDAGraphRunner.capture_all`); no-op on the CPU."""
        if self.device.type != 'cuda':
            return
        self.warm_up_eager()
        if self.graph_runner is not None:
            with self.streams.forward():
                self.graph_runner.capture_all()
                if self.verify_graphs is not None:
                    self.verify_graphs.capture_all()
                    self.head_graphs.capture_all()
                    if self.chain_graphs is not None:
                        self.chain_graphs.capture_all()
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def warm_up_eager(self) -> float:
        """Run the eager warm-up forwards (`warm_start.warm_up_plan`) on all-padding inputs; returns seconds."""
        began = time.perf_counter()
        kbs = self.cache_engine.cache_config.kernel_block_size
        shapes = warm_up_plan(self.max_forward_tokens, self.max_batch_size, kbs)
        for i, (q_lens, width) in enumerate(shapes):
            # greedy and random sampling in turn, so both paths and both batch-size classes of each are warm
            inputs, sampling = self.streams.to_device(
                padding_inputs(q_lens, kbs, has_lora=self.has_lora, table_width=width),
                warm_up_sampling(len(q_lens), i % 2 == 0, self.device))
            with self.streams.forward():
                hidden = self.model(self._context(inputs))
                logits = self.model.compute_logits(hidden[inputs.logits_indices])
                self._sample(torch.nan_to_num(logits, nan=0.0, posinf=0.0, neginf=0.0), sampling)
        if self.cache_engine.kv_pool.numel():   # the KV block copy kernel of prefix-cache saves / restores
            with self.streams.forward():        # block 0 onto itself: every word keeps its value
                self.cache_engine.copy_logical_blocks(torch.zeros(2, 1, dtype=torch.int64, device=self.device))
        if self.device.type == 'cuda':
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - began
        logger.info('eager warm-up: %d forwards (up to %d tokens, %d sequences) in %.2f s', len(shapes),
                    self.max_forward_tokens, self.max_batch_size, seconds)
        return seconds

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs, sampling: SamplingInputs,
                cache_inputs: CacheCheckpointInputs | None = None, feed: TokenFeed | None = None,
                defer: bool = False) -> ForwardOutput:
        """`feed`: tokens sampled by the forward before, written into the inputs on the device (async scheduling).
        `defer`: leave the sampled ids on the device with a pending host copy (`ForwardOutput.resolve`)."""
        with phase('upload'):
            inputs, (sampling, cache_inputs), feed = self._upload_plain(inputs, (sampling, cache_inputs), feed)
        with self.streams.forward():
            stopped = feed.apply(inputs) if feed is not None else None
            hidden, routes = self.run_model(inputs, cache_inputs, save=False)
            if inputs.logits_indices.numel() == 0:
                with phase('save'):
                    self.save(cache_inputs)
                return ForwardOutput([], None, routed_experts=_routes_to_host(routes))
            with phase('sample'):
                hidden = hidden[inputs.logits_indices]
                if stopped is not None:
                    hidden = TokenFeed.blank(hidden, feed.logit_rows, stopped)
                logits = self.model.compute_logits(hidden)
                next_ids, logprobs = self._sample(logits, sampling)
            # The tokens' copy to the host is queued before the checkpoint saves (they read the caches the forward
            # wrote, which sampling does not touch) and waited for by its own event, so no token waits for them.
            tokens = DeviceTokens(next_ids)
            with phase('save'):
                self.save(cache_inputs)
            if defer:
                return ForwardOutput(None, logprobs, logits, _routes_to_host(routes), tokens)
            return ForwardOutput(tokens.tolist(), logprobs, logits, _routes_to_host(routes))

    @torch.inference_mode()
    def forward_verify(self, inputs: ModelInputs, sampling: SamplingInputs,
                       cache_inputs: CacheCheckpointInputs | None, plan: VerifyPlan,
                       params: list[SampleParams | None], collect: bool
                       ) -> tuple[VerifyOutput, CacheCheckpointInputs | None, torch.Tensor]:
        """Speculative step, part 1 (`spec_decode`): restores, the target forward (keeping its pre-norm hidden
        states; graphs where they fit, `_target_hidden`), acceptance. Save copies wait for `draft`. Returns the
        verify output, the device copy plans (for `draft`) and the logits at each sampled sequence's last real
        token."""
        inputs, sampling, cache_inputs = self._upload(inputs, sampling, cache_inputs)
        with self.streams.forward():
            self.restore(cache_inputs)
            self.embed_images(inputs)
            out = self.spec.verify(inputs, self._target_hidden, plan, sampling, params, collect)
            return out, cache_inputs, out.first_logits

    @torch.inference_mode()
    def draft(self, fixups: CacheCheckpointInputs | None, plan: HeadPlan, hidden: torch.Tensor,
              chains: list[ModelInputs], params: list[SampleParams | None],
              cache_inputs: CacheCheckpointInputs | None, verified: CacheCheckpointInputs | None = None,
              greedy_chain: bool = False) -> PendingDrafts:
        """Speculative step, part 2: state fix-ups, the head's catch-up, the verify forward's save copies and those
        of the checkpoints at committed steps (`verified`), drafts. `greedy_chain`: the whole greedy chain replays
        at once (`greedy_chain_fits` held; `chains` holds chained step 1 only). The drafts' host copy is left
        pending (`PendingDrafts.resolve`)."""
        fixups, verified, head_inputs, *chains = self._upload(fixups, verified, plan.inputs, *chains)
        plan = plan._replace(inputs=head_inputs)
        with self.streams.forward():
            if fixups is not None:
                self.cache_engine.copy_state_slots(fixups.state_restore_plan)
            return self.spec.draft(self._head_hidden, plan, hidden, lambda step: chains[step - 1],
                                   params, lambda: (self.save(cache_inputs), self.save(verified)),
                                   chain=self.chain_graphs.run if greedy_chain else None)

    def _upload(self, *payloads, packed: bool | None = None):
        """A step's inputs on the device: every payload `packed_upload` can move in one pinned copy on the forward
        stream, the others (a `TokenFeed`, sampling inputs with per-row tensors) through `streams.to_device`.
        `packed` False: all through `streams.to_device`. Default (speculative steps): `LMDEPLOY_SPEC_CHAIN_GRAPH=0`
        (see `spec_chain`) turns it off; plain forwards pass `packed_uploads_enabled()` (on by default)."""
        if not (self._packed_uploads if packed is None else packed) or self.device.type != 'cuda':
            return self.streams.to_device(*payloads)  # (off CUDA a packed upload is the same `.to(device)`)
        return self._upload_with(payloads, lambda flat: upload_packed(flat, self.device))

    def _upload_with(self, payloads: tuple, pack: Callable[[list], list | None]) -> tuple | None:
        """`payloads` on the device: the packable ones through `pack` (called on the forward stream with the others
        as None; it returns them moved, or None to decline: nothing moved then, and this returns None), the rest
        through `streams.to_device`."""
        flat = [p is not None and packable(p) for p in payloads]
        with self.streams.forward():
            packed = pack([p if f else None for f, p in zip(flat, payloads)])
        if packed is None:
            return None
        rest = [None if f else p for f, p in zip(flat, payloads)]
        moved = self.streams.to_device(*rest) if any(p is not None for p in rest) else rest
        return tuple(q if f else m for f, q, m in zip(flat, packed, moved))

    def _upload_plain(self, inputs: ModelInputs, payloads: tuple, feed: TokenFeed | None
                      ) -> tuple[ModelInputs, tuple, TokenFeed | None]:
        """A plain forward's inputs on the device. One that replays a CUDA graph is staged: its inputs and the
        packable payloads go straight into the graph's static buffers in one copy (`StaticInputs.stage`; the feed
        and any other payload through `streams.to_device`). Otherwise, and with `LMDEPLOY_GRAPH_STAGING=0`, they go
        through `_upload` (`packed_uploads_enabled()`)."""
        runner = self.graph_runner
        if runner is not None and self._staged_uploads:
            def stage(flat: list) -> list | None:   # flat: inputs, the payloads, the feed (never packable)
                staged = None if flat[0] is None else runner.stage(flat[0], flat[1:-1])
                return None if staged is None else [staged[0], *staged[1], None]
            moved = self._upload_with((inputs, *payloads, feed), stage)
            if moved is not None:
                return moved[0], moved[1:-1], moved[-1]
        *moved, feed = self._upload(inputs, *payloads, feed, packed=self._plain_packed_uploads)
        return moved[0], tuple(moved[1:]), feed

    def greedy_chain_fits(self, first: ModelInputs) -> bool:
        """Whether the greedy chain of the drafting sequences whose chained step 1 is `first` (host inputs) replays
        as one graph (`spec_chain.DraftChainGraphs`)."""
        return self.chain_graphs is not None and \
            self.chain_graphs.size_of(first.batch_size, first.block_tables.size(1)) is not None

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, sampling: SamplingInputs) -> ForwardOutput:
        """Sample from logits kept from an earlier forward (no model run)."""
        (sampling,) = self.streams.to_device(sampling)
        with self.streams.forward():
            logits = logits.to(self.device, dtype=torch.float32)
            next_ids, logprobs = self._sample(logits, sampling)
            return ForwardOutput(next_ids.tolist(), logprobs, logits)

    @torch.inference_mode()
    def copy_only(self, cache_inputs: CacheCheckpointInputs) -> None:
        """Queue cache copies outside a forward (e.g. saving a finished request's reply checkpoint)."""
        (cache_inputs,) = self.streams.to_device(cache_inputs)
        with self.streams.forward():
            self.restore(cache_inputs)
            self.save(cache_inputs)

    @torch.inference_mode()
    def forward_logits(self, inputs: ModelInputs, cache_inputs: CacheCheckpointInputs | None = None,
                       feed: TokenFeed | None = None) -> tuple[torch.Tensor, np.ndarray | None]:
        """Logits of every fed token on the host (teacher forcing, for tests and scoring) and the routed-experts
        record (None unless asked); caches are updated as usual. The copies to the host are queued on the forward
        stream: the forward stream does not synchronise with the default stream, so a copy queued there could read
        the logits before a replayed graph has written them."""
        inputs, (cache_inputs,), feed = self._upload_plain(inputs, (cache_inputs,), feed)
        with self.streams.forward():
            stopped = feed.apply(inputs) if feed is not None else None
            hidden, routes = self.run_model(inputs, cache_inputs)
            if stopped is not None:
                hidden = TokenFeed.blank(hidden.clone(), feed.token_rows, stopped)
            return self.model.compute_logits(hidden).cpu(), _routes_to_host(routes)


def _routes_to_host(routes: torch.Tensor | None) -> np.ndarray | None:
    """The int16 device record as uint16 on the host (expert ids are < 2**15, so the bits are the same)."""
    return None if routes is None else routes.cpu().numpy().view(np.uint16)
