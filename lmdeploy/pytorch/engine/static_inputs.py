"""The static input buffers CUDA graphs read (`CUDAGraphRunner`, and the speculative runners in `spec_graphs.py`
and `spec_chain.py`), and staging: one host-to-device copy that fills them for a step.

Every buffer is a view into one device byte arena (`StaticInputs.arena`), in a fixed order: the token rows
(`input_ids`, `position_ids`, `slot_mapping`), the sequence rows (`q_lens`, `kv_lens`, `cu_seqlens_q`,
`state_ids`, `lora_ids`, `is_fresh`), the chunk indices, a scratch region for the step's other payloads
(`extra_bytes`), and the block table last. The padding contract of a graph key (pad tokens, the pad sequence, empty
sequences) is the module docstring of `cuda_graph.py`.

Two ways to fill the buffers for a key, with the same result in every row the key's graph reads:
- `fill_decode` / `fill_prefill`: device copies from inputs already on the device, then the padding written in
  place (about 25 small launches). The warm-up's all-padding runs and the speculative runners use these.
- `stage` (plain forwards, `ModelAgent`): the host writes the step's rows and padding into a pinned mirror of the
  arena with numpy, packs the step's other payloads (the logits rows, checkpoint copy plans, sampling tensors)
  into the scratch region, and one non-blocking copy moves the arena's prefix, up to the key's last block-table
  row, to the device. It replaces the step's upload and its fill (the host's ~1.4 ms of a 100-token suffix on the
  H200, profiled: run 22's phase table in docs/benchmarks.md).

Mirrors are a ring of `NUM_MIRRORS`: before the host writes one, it waits for the event recorded after that
mirror's last copy (a copy queued two steps back; done long before under async scheduling, which keeps one step
in flight). The copy itself is queued on the caller's stream (the forward stream), so it runs after the graph of
the step before has read the buffers.
"""
from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple

import numpy as np
import torch

from ..kernels.cuda.gated_delta_rule import max_graph_chunks, padded_chunk_indices_host
from ..model_inputs import ModelInputs
from .packed_upload import pack_into

_ALIGN = 16
NUM_MIRRORS = 2
# Scratch bytes for a staged step's other payloads, beyond 8 bytes per token (the logits rows of a forward that
# keeps every token's logits): checkpoint copy plans and sampling tensors are a few KiB at most batch sizes.
EXTRA_BYTES = 64 << 10
# Fields of `ModelInputs` the static buffers hold (the rest of a staged step's host tensors go to the scratch).
_STATIC_FIELDS = frozenset(('input_ids', 'position_ids', 'slot_mapping', 'q_lens', 'kv_lens', 'cu_seqlens_q',
                            'state_ids', 'is_fresh', 'block_tables', 'lora_ids'))


def graph_staging_enabled() -> bool:
    """Plain forwards that replay a graph stage their inputs (`StaticInputs.stage`) unless
    `LMDEPLOY_GRAPH_STAGING=0` (then: the packed upload and the fill, as before)."""
    return os.environ.get('LMDEPLOY_GRAPH_STAGING', '1') != '0'


class GraphKey(NamedTuple):
    num_tokens: int
    num_seqs: int
    decode: bool


def table_width(max_pages: int, max_tokens: int, kernel_block_size: int) -> int:
    """Columns of the static block-table buffer: `max_pages` (a real sequence's table) and at least the pages a
    pad sequence of up to `max_tokens` tokens reads (see `cuda_graph.py`'s module docstring)."""
    return max(max_pages, -(-max_tokens // kernel_block_size))


class _Mirror:
    """A host copy of the arena (pinned on CUDA), its numpy views by buffer name, and the event after its last
    copy to the device."""

    def __init__(self, regions: dict[str, tuple[int, torch.dtype, tuple[int, ...]]], size: int,
                 device: torch.device):
        self.bytes = torch.zeros(size, dtype=torch.uint8, pin_memory=device.type == 'cuda')
        raw = self.bytes.numpy()
        self.views = {name: raw[at:at + _nbytes(dtype, shape)].view(_np_dtype(dtype)).reshape(shape)
                      for name, (at, dtype, shape) in regions.items()}
        self.event = torch.cuda.Event() if device.type == 'cuda' else None
        self.used = False

    def wait(self) -> None:
        if self.used and self.event is not None:
            self.event.synchronize()


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()


def _np_dtype(dtype: torch.dtype):
    return {torch.int64: np.int64, torch.bool: np.bool_, torch.uint8: np.uint8}[dtype]


class StaticInputs:
    """Device buffers the captured graphs read; `view(key)` is the `ModelInputs` of the graph at `key`.
    `max_chunks > 0`: a chunk-index buffer for the chunked gated delta rule (hybrids on fla). `max_pages`: the
    widest block table a batch may bring; the buffer is `table_width` columns wide. `extra_bytes`: the scratch
    region `stage` packs a step's other payloads into (0: `stage` is not used)."""

    def __init__(self, max_tokens: int, max_seqs: int, max_pages: int, device: torch.device,
                 has_lora: bool = False, max_chunks: int = 0, kernel_block_size: int = 1, extra_bytes: int = 0):
        self.device = device
        self.width = table_width(max_pages, max_tokens, kernel_block_size)
        i64, seqs = torch.int64, (max_seqs,)
        layout = [('input_ids', i64, (max_tokens,)), ('position_ids', i64, (max_tokens,)),
                  ('slot_mapping', i64, (max_tokens,)), ('q_lens', i64, seqs), ('kv_lens', i64, seqs),
                  ('cu_seqlens_q', i64, (max_seqs + 1,)), ('state_ids', i64, seqs), ('lora_ids', i64, seqs),
                  ('is_fresh', torch.bool, seqs), ('chunk_indices', i64, (max_chunks, 2)),
                  ('extras', torch.uint8, (extra_bytes,)), ('block_tables', i64, (max_seqs, self.width))]
        self.regions: dict[str, tuple[int, torch.dtype, tuple[int, ...]]] = {}
        at = 0
        for name, dtype, shape in layout:
            self.regions[name] = (at, dtype, shape)
            at += _nbytes(dtype, shape)
            at += -at % _ALIGN
        self.arena = torch.zeros(at, dtype=torch.uint8, device=device)
        for name, (start, dtype, shape) in self.regions.items():
            setattr(self, name, self.arena[start:start + _nbytes(dtype, shape)].view(dtype).view(shape))
        self.slot_mapping.fill_(-1)
        # LoRA slots per sequence (0 = base model) when adapters are loaded: graphs then always run the LoRA op,
        # whose programs exit at once for base rows and padding.
        self.has_lora = has_lora
        self.logits_indices = torch.arange(max_tokens, dtype=torch.int64, device=device)
        self._arange = torch.arange(max(max_tokens, max_seqs) + 1, dtype=torch.int64, device=device)
        self.max_pages = max_pages
        if max_chunks == 0:
            self.chunk_indices = None
        self._mirrors: list[_Mirror] = []
        self._next = 0

    def view(self, key: GraphKey) -> ModelInputs:
        t, s = key.num_tokens, key.num_seqs
        chunked = self.chunk_indices is not None and not key.decode
        return ModelInputs(
            input_ids=self.input_ids[:t], position_ids=self.position_ids[:t], q_lens=self.q_lens[:s],
            kv_lens=self.kv_lens[:s], cu_seqlens_q=self.cu_seqlens_q[:s + 1], block_tables=self.block_tables[:s],
            slot_mapping=self.slot_mapping[:t], logits_indices=self.logits_indices[:t],
            state_ids=self.state_ids[:s], is_fresh=self.is_fresh[:s],
            lora_ids=self.lora_ids[:s] if self.has_lora else None,
            # host copies are shape placeholders here (upper bounds): a graph's kernels read device tensors only
            q_lens_list=[1 if key.decode else t] * s, kv_lens_list=[self.max_pages] * s,
            max_seqlen_q=1 if key.decode else t, max_seqlen_k=t, host_lens_exact=False,
            use_recurrent_kernel=not key.decode and not chunked,
            graph_chunk_indices=self.chunk_indices[:max_graph_chunks(t, s)] if chunked else None)

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
        self.block_tables[b:sg].zero_()  # the pad sequence reads page 0 only, within its (wide enough) row
        if self.chunk_indices is not None:
            lens = (inputs.q_lens_list if inputs is not None else []) + [tg - t]
            host = padded_chunk_indices_host(lens, max_graph_chunks(tg, sg), pad_seq=sg - 1)
            if self.device.type == 'cuda':
                host = host.pin_memory()  # a non-blocking copy from pageable memory would synchronise the stream
            self.chunk_indices[:host.shape[0]].copy_(host, non_blocking=True)

    def stage(self, inputs: ModelInputs, key: GraphKey, payloads: list) -> tuple[ModelInputs, list] | None:
        """Fill the buffers of `key` from host `inputs` with one copy (see the module docstring), queued on the
        current stream. Returns the step's inputs on the device (the real rows: views of the buffers, and of the
        scratch for the other tensors) and `payloads` (packable dataclasses or None) with their tensors in the
        scratch; None if they do not fit it (nothing is queued then: upload them the usual way)."""
        mirror = self._mirror()
        moved = pack_into([inputs, *payloads], mirror.views['extras'], self.extras, skip={0: _STATIC_FIELDS})
        if moved is None:
            return None
        _write_rows(mirror.views, inputs, key)
        if key.decode:
            _pad_decode(mirror.views, inputs.batch_size, key.num_seqs)
        else:
            _pad_prefill(mirror.views, inputs, key, self.chunk_indices is not None)
        end = self.regions['block_tables'][0] + key.num_seqs * self.width * 8   # int64 rows, the arena's last
        self.arena[:end].copy_(mirror.bytes[:end], non_blocking=True)
        if mirror.event is not None:
            mirror.event.record()
        mirror.used = True
        t, b, width = inputs.input_ids.numel(), inputs.batch_size, inputs.block_tables.size(1)
        views = dict(input_ids=self.input_ids[:t], position_ids=self.position_ids[:t],
                     slot_mapping=self.slot_mapping[:t], q_lens=self.q_lens[:b], kv_lens=self.kv_lens[:b],
                     cu_seqlens_q=self.cu_seqlens_q[:b + 1], state_ids=self.state_ids[:b],
                     is_fresh=self.is_fresh[:b], block_tables=self.block_tables[:b, :width],
                     lora_ids=None if inputs.lora_ids is None else self.lora_ids[:b])
        return dataclasses.replace(moved[0], **views), moved[1:]

    def _mirror(self) -> _Mirror:
        if not self._mirrors:
            size = self.arena.numel()
            self._mirrors = [_Mirror(self.regions, size, self.device) for _ in range(NUM_MIRRORS)]
        mirror = self._mirrors[self._next]
        self._next = (self._next + 1) % len(self._mirrors)
        mirror.wait()
        return mirror


def _np(t: torch.Tensor) -> np.ndarray:
    return t.numpy() if t.is_contiguous() else t.contiguous().numpy()


def _write_rows(v: dict[str, np.ndarray], inputs: ModelInputs, key: GraphKey) -> None:
    """The batch's own rows (`StaticInputs._copy_batch` on the host)."""
    t, b = inputs.input_ids.numel(), inputs.batch_size
    v['input_ids'][:t] = _np(inputs.input_ids)
    v['position_ids'][:t] = _np(inputs.position_ids)
    v['slot_mapping'][:t] = _np(inputs.slot_mapping)
    v['q_lens'][:b] = _np(inputs.q_lens)
    v['kv_lens'][:b] = _np(inputs.kv_lens)
    v['cu_seqlens_q'][:b + 1] = _np(inputs.cu_seqlens_q)
    v['state_ids'][:b] = _np(inputs.state_ids)
    v['is_fresh'][:b] = _np(inputs.is_fresh)
    v['block_tables'][:b, :inputs.block_tables.size(1)] = _np(inputs.block_tables)
    v['lora_ids'][:b] = 0 if inputs.lora_ids is None else _np(inputs.lora_ids)


def _pad_tokens(v: dict[str, np.ndarray], start: int, end: int) -> None:
    v['input_ids'][start:end] = 0
    v['position_ids'][start:end] = 0
    v['slot_mapping'][start:end] = -1


def _pad_decode(v: dict[str, np.ndarray], b: int, size: int) -> None:
    """`StaticInputs.fill_decode`'s padding rows on the host."""
    _pad_tokens(v, b, size)
    v['q_lens'][b:size] = 1
    v['cu_seqlens_q'][b + 1:size + 1] = np.arange(b + 1, size + 1)
    for name in ('kv_lens', 'state_ids', 'is_fresh', 'lora_ids'):
        v[name][b:size] = 0


def _pad_prefill(v: dict[str, np.ndarray], inputs: ModelInputs, key: GraphKey, chunked: bool) -> None:
    """`StaticInputs.fill_prefill`'s pad sequence, empty sequences and chunk indices on the host."""
    t, b = inputs.input_ids.numel(), inputs.batch_size
    tg, sg = key.num_tokens, key.num_seqs
    _pad_tokens(v, t, tg)
    for name in ('q_lens', 'kv_lens', 'state_ids', 'lora_ids'):
        v[name][b:sg] = 0
    v['q_lens'][b] = v['kv_lens'][b] = tg - t
    v['cu_seqlens_q'][b + 1:sg + 1] = tg
    v['is_fresh'][b:sg] = True
    v['block_tables'][b:sg] = 0  # the pad sequence reads page 0 only, within its (wide enough) row
    if chunked:
        rows = max_graph_chunks(tg, sg)
        v['chunk_indices'][:rows] = padded_chunk_indices_host(inputs.q_lens_list + [tg - t], rows,
                                                              pad_seq=sg - 1).numpy()
