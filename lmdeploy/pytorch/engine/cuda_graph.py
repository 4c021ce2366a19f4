"""CUDA graphs: capture the model once per padded batch shape, then replay (decode batches and prefills up to a
few thousand tokens, mixed prefill + decode batches included).

Owns: the static input buffers (one set, sized for the largest graph: `static_inputs.StaticInputs`, which also
stages a plain forward's host inputs into them with one copy), the captured graphs and their output buffers. Used
by `ModelAgent.run_model` on CUDA unless `eager_mode`; never touches scheduler state.

A graph is keyed by `(tokens, sequences)`:

- Decode (every sequence feeds one token): a batch of `B` is padded to the smallest capture size `G >= B` (1, 2,
  4, 8, then multiples of 16 up to `max_batch_size`), key `(G, G)`. These are captured at start-up.
- Prefills and mixed batches (`prefill_key`): `T` tokens of `B` sequences are padded to token bucket `Tg`
  (`PREFILL_TOKEN_BUCKETS`: 16, 32, ..., 256, 384, 512, 768, 1024, 1280, ..., 4096, up to `max_prefill_tokens`,
  see `prefill_graph_tokens`) and sequence bucket `Sg >= B + 2` (4, 8, 16, ..., then
  `max_batch_size + 2`), with `Tg > Sg` (so no prefill shape looks like a decode batch to a kernel that tells
  them apart by `T == B`). The `Tg - T` pad tokens form one extra sequence (index `B`) and the rest are empty
  sequences: the last one is always empty. Larger forwards, in-prefill checkpoints and image tokens run eagerly.
  `prefill_warm_keys` (one and two sequences, every token bucket) are captured at start-up, the others on first
  use, at most `max_prefill_graphs` of them (then eager, logged once).
- Hybrids on fla (`chunk_indices=True`): the gated delta rule runs fla's chunked kernels inside the graph, on the
  static `cu_seqlens` and static chunk indices of a fixed row count per bucket (`max_graph_chunks`), built on the
  host each step and copied non-blocking from pinned memory; the padding rows name chunk 0 of the last (empty)
  sequence, which fla's kernels mask out entirely (see `kernels/cuda/gated_delta_rule.py`); this is the default.
  With `LMDEPLOY_GRAPH_GDR=recurrent` the graph runs the token-by-token kernel (`ModelInputs.use_recurrent_kernel`).

Padding is harmless by construction of the kernels' contracts: pad tokens write no KV (`slot_mapping = -1`), pad
and empty sequences use state row 0 (a reserved dummy no sequence owns), decode padding rows have `kv_len = 0`
(decode attention writes zeros and reads nothing), and every other op is row-wise or per sequence, so whatever the
pad rows compute never reaches a real row. The pad sequence attends to its own `Tg - T` keys (`kv_len = q_len`),
so attention reads `ceil((Tg - T) / kernel_block_size)` entries of its block-table row: the table buffer is at
least that wide for the largest bucket (`table_width`), whatever `max_pages` (the longest session) is, and the pad
and empty rows are zeroed each fill, so those reads name page 0 and stay inside the row. (A table only
`max_pages` wide let a 4096-token pad sequence of a short-session engine read past its row and past the buffer:
the illegal memory accesses seen on the H200.)

The first run at a key runs eagerly *through the static buffers*: at start-up on all-padding inputs (it compiles /
autotunes every kernel for exactly the captured shapes and writes nothing a sequence owns), on first use with the
real step itself (capture executes nothing, so the step is not applied twice). Then the graph is captured; later
runs write their inputs into the buffers (`stage` from the host, else `_fill` on the device) and replay. A prefill
capture that fails is logged and its key runs eagerly from then on (the step's eager result stands), and torch's
capture state is left clean (`recover_from_failed_capture`: later graphs take a new pool, the generator's capture
mark is cleared), so later keys still capture and sampling still draws random numbers. Every
capture shares one memory pool; everything runs on the caller's current stream (the forward stream).
`capture_all` logs the start-up capture time and the memory the graphs took.

Prefill graphs are captured as a chain of graphs split at decoder-layer boundaries (`graph_chain.py`: why, and
how); decode graphs stay whole.

With `routes_shape` (routed experts on for the engine) every graph records the routed experts of its tokens into
one static `[max_tokens, num_moe_layers, top_k]` buffer (`routes_of` reads a batch's rows after a replay); the
MoE layers then do one small copy each, whether or not the batch asked.
"""
from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Callable

import torch
from torch import nn

from ..kernels.cuda.gated_delta_rule import max_graph_chunks
from ..model_inputs import ModelInputs, StepContext
from .graph_chain import GraphChain, capture_chain, split_layers
from .static_inputs import EXTRA_BYTES, GraphKey, StaticInputs
from .trace import phase

logger = logging.getLogger('lmdeploy')


def end_stale_pool_recording(device: torch.device, pool) -> bool:
    """After a failed capture into `pool`: stop the device allocator routing allocations to it, if the failure left
    it so (torch up to at least 2.11 checks `cudaStreamEndCapture` before it ends the allocator's recording, so an
    invalidated capture raises between the two). Returns whether there was such a recording (torch builds that end
    it on failure themselves raise here, and nothing changes). Not enough to reuse the pool: see
    `recover_from_failed_capture`."""
    if pool is None:
        return False
    try:
        torch._C._cuda_endAllocateToPool(device.index if device.index is not None else torch.cuda.current_device(),
                                         pool)
    except RuntimeError:
        return False
    return True


class CaptureStateError(RuntimeError):
    """CUDA graph capture no longer works after a failed one (`recover_from_failed_capture`): the engine cannot
    trust torch's capture state (its generator may refuse random ops), so start-up stops instead of serving on."""


def recover_from_failed_capture(device: torch.device, pool) -> tuple[tuple[int, int], torch.cuda.CUDAGraph]:
    """After a failed capture into `pool`: a new pool for later captures, and the graph that keeps it alive (hold it
    as long as the pool is used), with torch's capture state clean again. A capture that fails leaves three marks in
    torch 2.11 (H100 runs 64-66): the device allocator's recording into `pool` (`end_stale_pool_recording` ends it),
    the pinned-host allocator's recording into `pool` (no Python call ends it: every later capture into `pool` fails
    at its start, "beginAllocateToPool: already recording to mempool_id"), and the device's default CUDA generator
    marked as capturing (every random op outside a graph then raises, "Offset increment outside graph capture
    encountered unexpectedly", so sampled requests would fail). One capture of a small kernel into a new pool that
    ends cleanly clears the generator's mark (it keeps its state and offset) and proves the new pool usable; the
    graph must outlive the pool's use, as torch's host allocator refuses to capture into a pool whose graphs were
    all freed. Graphs captured before keep the old pool."""
    end_stale_pool_recording(device, pool)
    fresh = torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=fresh):  # torch's own side stream
            torch.zeros(1, device=device)
    except RuntimeError as exc:
        raise CaptureStateError(f'CUDA graph capture does not work after a failed capture: {exc}') from exc
    torch.cuda.synchronize(device)
    logger.info('a new graph memory pool for the captures after a failed one')
    return fresh, graph

# Powers of two up to 256 (forwards there are host-bound whatever their padding), then steps of a quarter or a half
# octave: a prompt just past an edge pads by at most 50% (256..1024) or 25% (1024..4096), where the device time
# of the pad tokens starts to count.
PREFILL_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096)
# Sequence counts of the prefill graphs captured at start-up: every sequence bucket up to `max_batch_size + 2`
# unless `LMDEPLOY_WARM_PREFILL_SEQS=n` asks for fewer (the buckets up to the one that holds n: `warm_prefill_seqs`;
# 2, the default before H200 run 29: a lone prompt, or a prompt beside one decode). A key first met by a request
# runs that step eagerly and then captures (`ModelAgent.forward_counts` counts them): in the 9B continuous-batching
# run with the old default, 26 first uses cost 5.2 s of host time in a 21 s run (busy share 0.86); with every
# bucket warm, none (0.976), for 13 s more start-up (docs/benchmarks.md, "H200 runs 26-29"). The cost in memory:
# each prefill graph keeps its output buffer ([bucket tokens, hidden]; estimated ~1.3 GB over every key of the 9B
# shape at max_batch_size 128, against ~0.2 GB for sequence bucket 4 alone; the start-up log gives the total).
MAX_PREFILL_GRAPHS = 48
# The prefill-graph limit unless LMDEPLOY_PREFILL_GRAPH_TOKENS says otherwise (256 restores the old limit, 0 turns
# prefill graphs off). 4096 with the chunked gated delta rule inside the graphs passed the H200 run of 2026-12-01
# (run 2) once the pad sequence's block-table row was wide enough (see `table_width`).
DEFAULT_PREFILL_GRAPH_TOKENS = 4096


def capture_sizes(max_batch_size: int) -> list[int]:
    """Padded decode batch sizes: 1, 2, 4, 8, 16, 32, 48, ... capped by (and including) the maximum."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch_size]
    sizes += list(range(16, max_batch_size, 16))
    return sorted(set(sizes) | {max_batch_size})


def prefill_graph_tokens(max_forward_tokens: int) -> int:
    """Tokens the prefill graphs cover: `max_forward_tokens` (the largest forward the scheduler makes), capped by
    `LMDEPLOY_PREFILL_GRAPH_TOKENS` (default `DEFAULT_PREFILL_GRAPH_TOKENS`; at most the largest bucket, 4096; 0
    turns prefill graphs off)."""
    cap = int(os.environ.get('LMDEPLOY_PREFILL_GRAPH_TOKENS', DEFAULT_PREFILL_GRAPH_TOKENS))
    return max(0, min(cap, max_forward_tokens))


def prefill_token_buckets(max_prefill_tokens: int) -> tuple[int, ...]:
    """Token buckets covering forwards of up to `max_prefill_tokens` tokens: every bucket below it and the first
    one at or above it (capped by the largest bucket)."""
    if max_prefill_tokens <= 0:
        return ()
    below = tuple(t for t in PREFILL_TOKEN_BUCKETS if t < max_prefill_tokens)
    above = next((t for t in PREFILL_TOKEN_BUCKETS if t >= max_prefill_tokens), None)
    return below + ((above,) if above is not None else ())


def prefill_seq_buckets(max_batch_size: int) -> tuple[int, ...]:
    """Sequence buckets of the prefill graphs: 4, 8, 16, ... below `max_batch_size + 2`, then that (a full batch
    plus the pad sequence plus one empty sequence)."""
    cap = max_batch_size + 2
    powers = [4 << i for i in range(max(1, cap.bit_length()))]
    return tuple(sorted({s for s in powers if s < cap} | {cap}))


def prefill_key(num_tokens: int, num_seqs: int, token_buckets: tuple[int, ...],
                seq_buckets: tuple[int, ...]) -> GraphKey | None:
    """The prefill graph for `num_tokens` tokens of `num_seqs` sequences: the smallest sequence bucket with room
    for the pad sequence and one empty sequence, then the smallest token bucket that holds the tokens and has more
    tokens than sequences. None: no bucket fits (eager)."""
    seqs = next((s for s in seq_buckets if s >= num_seqs + 2), None)
    if seqs is None:
        return None
    tokens = next((t for t in token_buckets if t >= num_tokens and t > seqs), None)
    return None if tokens is None else GraphKey(tokens, seqs, False)


def warm_prefill_seqs(max_batch_size: int) -> int:
    """Sequences of the largest batch the start-up prefill graphs cover: `LMDEPLOY_WARM_PREFILL_SEQS` (a positive
    int), by default `max_batch_size` (every sequence bucket)."""
    raw = os.environ.get('LMDEPLOY_WARM_PREFILL_SEQS')
    if raw is None:
        return max_batch_size
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f'LMDEPLOY_WARM_PREFILL_SEQS must be a positive integer, got {raw!r}')
    return int(raw)


def prefill_warm_keys(token_buckets: tuple[int, ...], seq_buckets: tuple[int, ...],
                      max_seqs: int = 2) -> list[GraphKey]:
    """Prefill graphs captured at start-up, largest first: every token bucket at every sequence bucket up to the
    one of `max_seqs` sequences (each bucket's key for the most sequences it holds, at most `max_seqs`; the
    default, 2: sequence bucket 4 only)."""
    buckets = {next((s for s in seq_buckets if s >= n + 2), None) for n in range(1, max_seqs + 1)} - {None}
    counts = {min(max_seqs, s - 2) for s in buckets}
    keys = {prefill_key(t, min(n, t), token_buckets, seq_buckets) for t in token_buckets for n in counts}
    return sorted((k for k in keys if k is not None), reverse=True)


class CUDAGraphRunner:
    """Runs forwards of `model` through captured CUDA graphs (see the module docstring)."""

    def __init__(self, model: nn.Module, make_context: Callable[[ModelInputs, torch.Tensor | None], StepContext],
                 max_batch_size: int, max_pages: int, device: torch.device,
                 max_prefill_tokens: int = 256, routes_shape: tuple[int, int] | None = None,
                 has_lora: bool = False, chunk_indices: bool = False,
                 max_prefill_graphs: int = MAX_PREFILL_GRAPHS, kernel_block_size: int = 1):
        """`max_prefill_tokens`: the largest forward the prefill graphs should cover (0: decode graphs only).
        `chunk_indices`: prefill graphs run the chunked gated delta rule on static chunk indices (hybrids on fla);
        otherwise the token-by-token one. `kernel_block_size`: tokens per KV page (sizes the block-table buffer
        for the pad sequence, see the module docstring; 1, the default, is the widest, safe for any page size)."""
        self.model = model
        self.make_context = make_context
        self.sizes = capture_sizes(max_batch_size)
        self.max_batch_size = max_batch_size
        self.token_buckets = prefill_token_buckets(max_prefill_tokens)
        self.seq_buckets = prefill_seq_buckets(max_batch_size)
        self.device = device
        max_seqs = max(max_batch_size, self.seq_buckets[-1])
        max_tokens = max((max_batch_size, *self.token_buckets))
        max_chunks = max((max_graph_chunks(t, self.seq_buckets[-1]) for t in self.token_buckets), default=0)
        self.static = StaticInputs(max_tokens, max_seqs, max_pages, device, has_lora=has_lora,
                                   max_chunks=max_chunks if chunk_indices else 0,
                                   kernel_block_size=kernel_block_size, extra_bytes=EXTRA_BYTES + 8 * max_tokens)
        self.static_routes = None if routes_shape is None else \
            torch.zeros((max_tokens, *routes_shape), dtype=torch.int16, device=device)
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.max_prefill_graphs = max_prefill_graphs
        self.failed: set[GraphKey] = set()  # prefill keys whose capture failed: eager from then on
        self.split_layers = split_layers()  # prefill graphs end after these many layers (and begin again)
        self._warned_full = False
        self.pool = None
        # each keeps the pool taken after a failed capture alive (`recover_from_failed_capture`)
        self.recovery_graphs: list = []
        self.num_replays = 0
        self.num_prefill_replays = 0
        self.capture_seconds = 0.0   # start-up capture (`capture_all`)
        self.num_first_uses = 0      # keys first met by a request: its step ran eagerly, then the key was captured
        self.first_use_seconds = 0.0  # host time of those steps (the eager run and the capture)
        self.capture_bytes = 0       # device memory the start-up captures reserved
        self._staged: tuple[ModelInputs, GraphKey] | None = None  # `stage`'s inputs: `run` skips their fill
        self.num_staged = 0          # forwards whose inputs `stage` wrote into the static buffers

    def padded_size(self, batch_size: int) -> int:
        return next(s for s in self.sizes if s >= batch_size)

    def key_of(self, inputs: ModelInputs) -> GraphKey | None:
        """The graph that can run `inputs`, or None (eager). The inputs `stage` wrote this step have their key
        already (nothing captures between the two)."""
        staged = self._staged
        if staged is not None and staged[0] is inputs:
            return staged[1]
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
        key = prefill_key(num_tokens, num_seqs, self.token_buckets, self.seq_buckets)
        if key is None or key in self.failed:
            return None
        if key not in self.graphs and self.num_prefill_graphs >= self.max_prefill_graphs:
            if not self._warned_full:
                logger.info('%d prefill CUDA graphs captured (the limit): new prefill shapes run eagerly',
                            self.num_prefill_graphs)
                self._warned_full = True
            return None
        return key

    @property
    def num_prefill_graphs(self) -> int:
        return sum(not k.decode for k in self.graphs)

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

    def stage(self, inputs: ModelInputs, payloads: list) -> tuple[ModelInputs, list] | None:
        """Host `inputs` of a forward a graph runs, written into the static buffers with one copy together with the
        step's other `payloads` (`StaticInputs.stage`, on the current stream): the device inputs and payloads, or
        None (no graph runs these inputs, or the payloads do not fit; nothing was queued). `run` of the returned
        inputs then skips the fill."""
        key = self.key_of(inputs)
        if key is None:
            return None
        staged = self.static.stage(inputs, key, payloads)
        if staged is not None:
            self._staged = (staged[0], key)
            self.num_staged += 1
        return staged

    def run(self, inputs: ModelInputs, key: GraphKey | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] of the batch (`supports(inputs)` must hold; `key`: its `key_of`, if known)."""
        key = key or self.key_of(inputs)
        staged, self._staged = self._staged, None
        if staged is None or staged[0] is not inputs or staged[1] != key:
            with phase('graph_fill'):
                self._fill(inputs, key)
        num_tokens = inputs.input_ids.numel()
        entry = self.graphs.get(key)
        if entry is None:
            began = time.perf_counter()
            static_inputs = self.static.view(key)
            out = self.model(self._context(static_inputs))  # the real step, eager, on the captured shapes
            self._capture_or_give_up(key, static_inputs)
            self.num_first_uses += 1
            self.first_use_seconds += time.perf_counter() - began
            return out[:num_tokens]
        graph, out = entry
        with phase('graph_launch'):
            graph.replay()
        self.num_replays += 1
        self.num_prefill_replays += not key.decode
        return out[:num_tokens]

    def fill_padding(self, key: GraphKey) -> None:
        """The static buffers of `key` as all padding (a replay then writes nothing a sequence owns; the benchmarks
        time launches after it)."""
        self._fill(None, key)

    def _fill(self, inputs: ModelInputs | None, key: GraphKey) -> None:
        if key.decode:
            self.static.fill_decode(inputs, key.num_seqs)
        else:
            self.static.fill_prefill(inputs, key)

    def capture_all(self) -> None:
        """Capture every decode size and the warm prefill keys (`prefill_warm_keys`) up front, largest first (so
        smaller graphs reuse its pool memory). Each warm-up run is all padding, so it writes nothing any sequence
        owns: no KV (slot -1), only the dummy state row. Logs the time and memory this took."""
        start, reserved = time.perf_counter(), torch.cuda.memory_reserved(self.device)
        keys = [GraphKey(size, size, True) for size in reversed(self.sizes)]
        keys += prefill_warm_keys(self.token_buckets, self.seq_buckets, warm_prefill_seqs(self.max_batch_size))
        for key in keys:
            if key in self.graphs or key in self.failed:
                continue
            if key.decode:
                self._warm_and_capture(key)
                continue
            try:
                self._warm_and_capture(key)
            except CaptureStateError:
                raise
            except Exception as exc:  # noqa: BLE001 - a prefill shape that cannot run here stays eager
                self.failed.add(key)
                torch.cuda.synchronize(self.device)
                logger.warning('warming up a prefill CUDA graph for %s failed (%s: %s); that shape runs eagerly',
                               key, type(exc).__name__, exc)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        self.capture_bytes = torch.cuda.memory_reserved(self.device) - reserved
        logger.info('CUDA graphs at start-up: %d decode + %d prefill captured in %.2f s, %.0f MiB reserved',
                    len(self.graphs) - self.num_prefill_graphs, self.num_prefill_graphs, self.capture_seconds,
                    self.capture_bytes / 2**20)

    def _warm_and_capture(self, key: GraphKey) -> None:
        self._fill(None, key)
        static_inputs = self.static.view(key)
        self.model(self._context(static_inputs))  # compile / autotune for exactly these shapes
        self._capture_or_give_up(key, static_inputs)

    def _capture_or_give_up(self, key: GraphKey, static_inputs: ModelInputs) -> None:
        """Capture `key`; a prefill capture that fails is logged and the key runs eagerly from then on (decode
        graphs have always captured: a failure there is a bug and raises)."""
        if key.decode:
            self._capture(key, static_inputs)
            return
        try:
            self._capture(key, static_inputs)
        except Exception as exc:  # noqa: BLE001 - any capture failure: fall back to eager, keep serving
            self.failed.add(key)
            self.pool, keep = recover_from_failed_capture(self.device, self.pool)
            self.recovery_graphs.append(keep)
            logger.warning('capturing a prefill CUDA graph for %s failed (%s: %s); that shape runs eagerly',
                           key, type(exc).__name__, exc)

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
            if key.decode or not self.split_layers:
                with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode='thread_local'):
                    out = self.model(self._context(static_inputs))
            else:
                graph, out = capture_chain(self.model, self._context(static_inputs), self.pool, stream,
                                           self.split_layers)
        finally:
            if gc_enabled:
                gc.enable()
        self.graphs[key] = (graph, out)
        logger.info('captured a CUDA graph for %s%s', key,
                    f' as {len(graph)} graphs' if isinstance(graph, GraphChain) else '')
