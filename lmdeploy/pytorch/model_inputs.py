"""Per-forward device inputs shared by the engine (producer) and the model/nn/backend layers (consumers).

A forward is a packed varlen batch: sequence b feeds `q_lens[b]` new tokens at positions
`[kv_lens[b] - q_lens[b], kv_lens[b])`; its KV lives in the kernel pages listed in `block_tables[b]`.
Decodes are simply sequences with `q_len == 1`, so prefills and decodes mix freely.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import NamedTuple

import torch


@dataclass
class StateCuts:
    """In-prefill state checkpoints of one forward (hybrid models): after the first `offsets[i]` new tokens of batch
    row `rows[i]` (0 < offset < q_len), every recurrent layer copies that row's state (conv history and recurrent
    state) into state-pool row `slots[i]`. Host-side only: prefills run eagerly.

    The recurrent kernels are not split per cut by the model: the gated delta rule runs in rounds over the segments
    between cuts (one call per round for all rows, continuing from the pool), and the conv history at a cut is read
    directly from the conv inputs; see `nn.gated_delta`.
    """
    rows: list[int]
    offsets: list[int]
    slots: list[int]
    # Per batch row (copies of the forward's host data): new tokens, state slot, fresh flag.
    q_lens: list[int]
    state_ids: list[int]
    is_fresh: list[bool]


class ImagePixels(NamedTuple):
    """A preprocessed image as the vision tower takes it: pixels `[t * h * w, C * temporal_patch * patch**2]` in
    the processor's patch order and the patch grid (t, h, w). The payload of an image's `MultiModalSpan.data`."""
    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]


@dataclass
class VisionItem:
    """One image of a forward. Merged tokens `[first_token, first_token + num_tokens)` of its embeddings fill
    `num_tokens` consecutive entries of `ModelInputs.mm_token_rows`, in item order (the whole image unless a chunk
    boundary cuts it). `content_hash` keys the encoder cache."""
    content_hash: int
    pixels: ImagePixels
    first_token: int
    num_tokens: int


@dataclass
class ModelInputs:
    input_ids: torch.Tensor            # [T] int64
    position_ids: torch.Tensor         # [T] int64
    q_lens: torch.Tensor               # [B] int64: new tokens per sequence
    kv_lens: torch.Tensor              # [B] int64: history + new tokens per sequence
    cu_seqlens_q: torch.Tensor         # [B+1] int64
    block_tables: torch.Tensor         # [B, max_pages] int64 kernel-page ids (padded with 0)
    slot_mapping: torch.Tensor         # [T] int64: page * kernel_block_size + offset where each new token's KV goes
    logits_indices: torch.Tensor       # [S] int64: rows of the hidden states whose logits are sampled
    state_ids: torch.Tensor            # [B] int64 state-pool rows (hybrid models; 0 = dummy otherwise)
    is_fresh: torch.Tensor             # [B] bool: recurrent state starts from zero (never read the slot)
    # Host copies, so default-backend loops never synchronise with the device.
    q_lens_list: list[int] = field(default_factory=list)
    kv_lens_list: list[int] = field(default_factory=list)
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    # False in CUDA-graph views, whose host lists and max_seqlen_* are shape placeholders (upper bounds): a kernel
    # choice that needs the real host lengths must check it.
    host_lens_exact: bool = True
    # LoRA: adapter slot of each sequence [B] int64 (0 = the base model; see `nn.lora`). None: no sequence of this
    # forward uses an adapter, and LoRA layers skip their adapters entirely.
    lora_ids: torch.Tensor | None = None
    # In-prefill state checkpoints (None: none this forward).
    state_cuts: StateCuts | None = None
    # Verify forwards of K drafts per sequence, on the device ([B, K] int64; None elsewhere): every sequence feeds
    # exactly K + 1 tokens (packed in order) and the state after its first j + 1 tokens also goes to pool row
    # `draft_state_slots[b, j]`. The same cuts as `state_cuts` at offsets 1 .. K, with a structure fixed by the
    # shape alone, so CUDA graphs can replay them (`nn.draft_cuts`).
    draft_state_slots: torch.Tensor | None = None
    # M-RoPE positions [3, T] (temporal, height, width) when this forward feeds image tokens; None otherwise, and
    # then `position_ids` (which already include each sequence's image offset) serve all three axes.
    mrope_position_ids: torch.Tensor | None = None
    # Rows of the packed batch whose embeddings come from images ([N] int64), the images in row order (host
    # records, whole images only: chunking never splits one) and, once the agent has encoded them, their
    # embeddings [N, hidden].
    mm_token_rows: torch.Tensor | None = None
    vision_items: list[VisionItem] = field(default_factory=list)
    mm_embeds: torch.Tensor | None = None
    # Run the gated delta rule token by token even for multi-token sequences (CUDA-graph prefills: the chunked
    # kernels index their chunks from the sequence lengths, built per forward, which a replayed graph cannot redo).
    use_recurrent_kernel: bool = False
    # CUDA-graph prefills on fla: the chunked gated delta rule's chunk indices [N, 2] int64 in a static buffer,
    # padded to the bucket's fixed row count (`kernels.cuda.gated_delta_rule.padded_chunk_indices_host`); None
    # elsewhere (eager forwards build theirs from `q_lens_list`).
    graph_chunk_indices: torch.Tensor | None = None
    # Record the top-k expert ids every MoE layer routes each fed token to (`StepContext.routed_experts`); the
    # forward's output then carries them. False costs nothing.
    record_routed_experts: bool = False
    # Per-forward memo of device index tensors a backend derives from the host data (see `derived`); a copy made
    # by `dataclasses.replace` or `to` starts empty.
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def derived(self, key, build):
        """Memoise a per-forward index tensor (built once, shared by every layer)."""
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]

    @property
    def batch_size(self) -> int:
        return len(self.q_lens_list)

    @property
    def is_decode(self) -> bool:
        return self.max_seqlen_q == 1

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> ModelInputs:
        values = {}
        for f in fields(self):
            if not f.init:
                continue
            value = getattr(self, f.name)
            values[f.name] = value.to(device, non_blocking=non_blocking) if isinstance(value, torch.Tensor) else value
        return ModelInputs(**values)


def upload_index_tensors(host: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Small host index tensors (int64 or bool) on `device`, for index data built during a forward. On CUDA they
    travel packed in one pinned buffer, copied non-blocking on the current stream: a copy from pageable memory would
    synchronise the stream, and the device would then idle while the host queues the next kernels."""
    if device.type != 'cuda' or not any(t.numel() for t in host.values()):  # nothing to copy: no transfer at all
        return {name: t.to(device) for name, t in host.items()}
    flat = [t.reshape(-1).to(torch.int64) for t in host.values()]
    packed = torch.cat(flat).pin_memory().to(device, non_blocking=True)
    pieces = packed.split([f.numel() for f in flat])
    return {name: piece.view(t.shape).to(t.dtype) for (name, t), piece in zip(host.items(), pieces)}


@dataclass
class StepContext:
    """Everything a model forward reads besides weights: inputs plus views into the cache pools."""
    inputs: ModelInputs
    # Per full-attention layer (in `ModelConfig.attn_layer_ids` order): (k_cache, v_cache), each
    # [num_pages, kernel_block_size, num_kv_heads, head_dim].
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    # Per recurrent layer (in `ModelConfig.recurrent_layer_ids` order): name -> [num_slots, *shape] pool view.
    state_caches: list[dict[str, torch.Tensor]] = field(default_factory=list)
    kernel_block_size: int = 64
    # Routed-experts record of this forward, or None (nothing is recorded): [T, num_moe_layers, top_k] int16. MoE
    # layer i writes the top-k expert ids its router chose for every fed token into `[:, i]` (see `routes_of`).
    routed_experts: torch.Tensor | None = None
    # Called with i after decoder layer i returns, or None: the CUDA graph runner ends one graph's capture and
    # begins the next one there (`engine/graph_chain.py`, split prefill graphs). Eager forwards leave it None.
    after_layer: Callable[[int], None] | None = None

    def routes_of(self, moe_index: int) -> torch.Tensor | None:
        """Where MoE layer `moe_index` (its rank among the MoE layers) records its top-k ids, or None."""
        return None if self.routed_experts is None else self.routed_experts[:, moe_index]


@dataclass
class SamplingInputs:
    """Per-row sampling parameters for the sequences sampled in one forward (rows of `logits_indices`)."""
    temperature: torch.Tensor          # [S] float32, 0 = greedy
    top_k: torch.Tensor                # [S] int64, 0 = off
    top_p: torch.Tensor                # [S] float32, 1 = off
    repetition_penalty: torch.Tensor   # [S] float32, 1 = off
    # Per row: ids already in the sequence (for the repetition penalty), or None when the penalty is off.
    penalty_ids: list[torch.Tensor | None]
    # Per row: ids that may not be sampled yet (stop ids before `min_new_tokens`), or None.
    banned_ids: list[torch.Tensor | None]
    # Per row: a seeded generator, or None to use the global RNG.
    generators: list[torch.Generator | None]
    max_num_logprobs: int = -1  # -1: no logprobs
    all_greedy: bool = True
    # OpenAI-style options; None when no row of the batch uses them (then they cost nothing).
    # Per row: the generated ids (for presence / frequency penalties), or None when both are 0.
    output_ids: list[torch.Tensor | None] | None = None
    presence_penalty: torch.Tensor | None = None   # [S] float32
    frequency_penalty: torch.Tensor | None = None  # [S] float32
    min_p: torch.Tensor | None = None              # [S] float32, 0 = off
    # Per row: (token ids [n] int64, biases [n] float32), or None.
    logit_bias: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None
    # [S, ceil(V / 32)] int32 bitmask of the tokens each row may sample (grammars); None when no row has one.
    token_bitmask: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        out = [self.temperature, self.top_k, self.top_p, self.repetition_penalty]
        out += [t for t in self.penalty_ids + self.banned_ids if t is not None]
        out += [t for t in (self.presence_penalty, self.frequency_penalty, self.min_p) if t is not None]
        out += [t for t in self.output_ids or () if t is not None]
        out += [t for pair in self.logit_bias or () if pair is not None for t in pair]
        if self.token_bitmask is not None:
            out.append(self.token_bitmask)
        return out

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SamplingInputs:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)
        return SamplingInputs(
            temperature=move(self.temperature), top_k=move(self.top_k), top_p=move(self.top_p),
            repetition_penalty=move(self.repetition_penalty), penalty_ids=[move(t) for t in self.penalty_ids],
            banned_ids=[move(t) for t in self.banned_ids], generators=self.generators,
            max_num_logprobs=self.max_num_logprobs, all_greedy=self.all_greedy,
            output_ids=None if self.output_ids is None else [move(t) for t in self.output_ids],
            presence_penalty=move(self.presence_penalty), frequency_penalty=move(self.frequency_penalty),
            min_p=move(self.min_p),
            logit_bias=None if self.logit_bias is None else [
                None if pair is None else (move(pair[0]), move(pair[1])) for pair in self.logit_bias],
            token_bitmask=move(self.token_bitmask))
