"""Hot per-request records shared by the scheduler, the inputs maker and the engine loop.

A `SchedulerSequence` is the engine's view of one request: its tokens, how many of them already have KV (and
recurrent state) computed, the blocks and state slot it owns, and its sampling parameters. No torch.

`token_ids` only ever grows by appends (prompt, then one sampled token per step). `token_array()` keeps an int64
copy of it that is converted once and then extended by the appended tokens, so matching and input building never
convert the whole list again.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import numpy as np

from .routed_experts import RoutedExperts

# Ranges the sampling kernels accept (`backends/default/sampling.py`): parameters travel as float32 / int64 tensors
# and seeds go to `torch.Generator.manual_seed`.
_FLOAT32_MAX = 3.4028234663852886e38
_FLOAT32_TINY = 1.1754943508222875e-38   # smallest normal float32: a smaller penalty divides logits to inf
_INT64_MAX = 2**63 - 1
SEED_RANGE = (-2**63, 2**64 - 1)
MAX_LOGPROBS = 64


def _is_int(value) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()
    ABORTED = enum.auto()


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 512
    min_new_tokens: int = 0
    # 0 means greedy.
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    # Token ids that finish the request (eos included unless ignore_eos).
    stop_token_ids: tuple[int, ...] = ()
    # Multi-token stop sequences, matched against the tail of the generated ids.
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    random_seed: int | None = None
    logprobs: int | None = None
    # Return the experts every MoE layer routed each position to (needs `enable_return_routed_experts`).
    return_routed_experts: bool = False
    # OpenAI penalties over the generated tokens: logit -= frequency * count + presence * (count > 0).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Drop tokens whose probability (after temperature) is below min_p times the most likely one's; 0 = off.
    min_p: float = 0.0
    # (token id, bias) pairs added to the logits before any other processing.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # A compiled grammar (`xgrammar.CompiledGrammar`) every sampled token must follow; None: unconstrained.
    grammar: object | None = field(default=None, compare=False, repr=False)

    @property
    def has_output_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise `ValueError` naming the first field outside what the sampling kernels accept. The engine calls it
        at admission (`Engine.add_request`), so a request that passes cannot fail the batch it joins through its
        parameters; front ends call it earlier, in the caller's thread (HTTP 400). New sampling parameters add
        their range check here."""
        _check(_is_int(self.max_new_tokens) and 0 <= self.max_new_tokens <= _INT64_MAX,
               f'max_new_tokens must be an int in [0, 2**63), got {self.max_new_tokens!r}')
        _check(_is_int(self.min_new_tokens) and 0 <= self.min_new_tokens <= _INT64_MAX,
               f'min_new_tokens must be an int in [0, 2**63), got {self.min_new_tokens!r}')
        _check(_is_real(self.temperature) and math.isfinite(self.temperature)
               and 0 <= self.temperature <= _FLOAT32_MAX,
               f'temperature must be a finite number >= 0 (float32), got {self.temperature!r}')
        _check(_is_real(self.top_p) and math.isfinite(self.top_p) and 0 < self.top_p <= 1,
               f'top_p must be a number in (0, 1], got {self.top_p!r}')
        _check(_is_int(self.top_k) and 0 <= self.top_k <= _INT64_MAX,
               f'top_k must be an int in [0, 2**63) (0: off), got {self.top_k!r}')
        _check(_is_real(self.repetition_penalty) and math.isfinite(self.repetition_penalty)
               and _FLOAT32_TINY <= self.repetition_penalty <= _FLOAT32_MAX,
               f'repetition_penalty must be a positive finite float32 (in [1.2e-38, 3.4e38]), '
               f'got {self.repetition_penalty!r}')
        _check(self.random_seed is None or (_is_int(self.random_seed)
                                            and SEED_RANGE[0] <= self.random_seed <= SEED_RANGE[1]),
               f'random_seed must be None or an int in [-2**63, 2**64), got {self.random_seed!r}')
        top = MAX_LOGPROBS if vocab_size is None else min(MAX_LOGPROBS, vocab_size)
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= top),
               f'logprobs must be None or an int in [0, {top}], got {self.logprobs!r}')
        limit = _INT64_MAX + 1 if vocab_size is None else vocab_size
        bad = [t for t in self.stop_token_ids if not _is_int(t) or not 0 <= t < limit]
        _check(not bad, f'stop_token_ids outside the vocabulary [0, {limit}): {bad[:8]}')
        bad = [s for s in self.stop_sequences if not s or any(not _is_int(t) or not 0 <= t < limit for t in s)]
        _check(not bad, f'stop_sequences must be non-empty token id sequences in [0, {limit}), got {bad[:4]}')
        for name in ('presence_penalty', 'frequency_penalty'):
            value = getattr(self, name)
            _check(_is_real(value) and math.isfinite(value) and -2 <= value <= 2,
                   f'{name} must be a number in [-2, 2], got {value!r}')
        _check(_is_real(self.min_p) and math.isfinite(self.min_p) and 0 <= self.min_p <= 1,
               f'min_p must be a number in [0, 1], got {self.min_p!r}')
        bad = [(t, b) for t, b in self.logit_bias if not _is_int(t) or not 0 <= t < limit
               or not _is_real(b) or not math.isfinite(b) or not -100 <= b <= 100]
        _check(not bad, f'logit_bias must map token ids in [0, {limit}) to numbers in [-100, 100], got {bad[:4]}')


@dataclass(frozen=True)
class MultiModalSpan:
    """Positions `[start, end)` hold embeddings of one multimodal item whose content hash is `content_hash`.

    `grid` is the item's (t, h, w) grid in merged-token units (t * h * w == end - start) when it takes M-RoPE
    positions; None for an item laid out like text. `data` is the engine's opaque payload for encoding the item
    (the preprocessed pixels and patch grid); it takes no part in identity, which is `content_hash`.
    """
    start: int
    end: int
    content_hash: int
    grid: tuple[int, int, int] | None = None
    data: object = field(default=None, compare=False, repr=False)

    @property
    def num_positions(self) -> int:
        """Rotary positions the item advances the sequence by (max(h, w) for an M-RoPE grid, its length else)."""
        return max(self.grid[1], self.grid[2]) if self.grid is not None else self.end - self.start

    @property
    def position_delta(self) -> int:
        """Position offset the item introduces: the tokens after it sit at `index + delta` (<= 0 for images)."""
        return self.num_positions - (self.end - self.start)


@dataclass(slots=True, eq=False)
class SchedulerSequence:
    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    arrival: int = 0
    adapter_name: str | None = None
    mm_spans: tuple[MultiModalSpan, ...] = ()
    status: SequenceStatus = SequenceStatus.WAITING
    # Tokens [0, num_computed) have KV in `block_ids` and (hybrid) recurrent state in `state_slot`.
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    state_slot: int | None = None
    # Prompt tokens served from the prefix cache at the latest admission.
    num_cached: int = 0
    num_preemptions: int = 0
    # A prefill chunk must end exactly here (a branch point to checkpoint); None when there is none.
    checkpoint_hint: int | None = None
    # In-prefill checkpoints taken for this sequence so far (bounded by prefix_cache_prefill_state_cap).
    num_prefill_checkpoints: int = 0
    finish_reason: str | None = None
    # Async scheduling: tokens sampled by forwards still in flight, not yet in `token_ids` (their values are on the
    # device; a later forward is fed them there). They count as remaining to feed, not as generated.
    num_pending: int = 0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    # Routed experts of positions [0, num_computed) (engine flag on and the request asked, or the prefix cache keeps
    # them); None: not recorded.
    routed_experts: RoutedExperts | None = None
    # Speculative decoding (MTP): draft tokens proposed after the last token (the next verify forward feeds them
    # after it; never part of `token_ids` until accepted), their draft distributions (a device tensor
    # [len(draft_ids), vocab] for sampled requests, None for greedy; opaque here), the spare state rows the verify
    # forward cuts the state into after each draft position (allocated with `state_slot`, freed with it), and whether
    # the next head pass must also recompute position num_computed - 1 (after a prefix-cache hit, which skipped it).
    draft_ids: list[int] = field(default_factory=list)
    draft_probs: object | None = field(default=None, repr=False)
    draft_slots: list[int] = field(default_factory=list)
    needs_draft_overlap: bool = False
    # int64 copy of `token_ids[:_array_len]` (capacity may exceed it) and the list object it was converted from.
    _array: np.ndarray | None = field(default=None, init=False, repr=False)
    _array_src: list[int] | None = field(default=None, init=False, repr=False)
    _array_len: int = field(default=0, init=False, repr=False)
    # Bumped when `token_array()` is rebuilt rather than extended: data derived from the tokens must be rebuilt too.
    token_epoch: int = field(default=0, init=False, repr=False)
    # Per-request data the prefix cache derives from the tokens (prefix hashes); owned by paging, opaque here.
    prefix_memo: object | None = field(default=None, init=False, repr=False)
    # The grammar matcher of a constrained request (`engine/guided_decoding.py`); opaque here.
    grammar_state: object | None = field(default=None, init=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def token_array(self) -> np.ndarray:
        """`token_ids` as a read-only int64 array. Tokens appended since the last call are copied in; a replaced or
        shorter list, or a changed last token, rebuilds it. Returned arrays never change later (appends write past
        their end, a rebuild or a growth writes a new buffer)."""
        ids, have, buf = self.token_ids, self._array_len, self._array
        n = len(ids)
        if buf is None or ids is not self._array_src or n < have or (have and ids[have - 1] != buf[have - 1]):
            # Exact size (appends grow it by doubling); fromiter is the fastest conversion of a list of ints.
            buf = np.array(ids, dtype=np.int64) if isinstance(ids, np.ndarray) else np.fromiter(ids, np.int64, n)
            self._array, self._array_src = buf, ids
            self.token_epoch += 1
        elif n > have:
            if n > len(buf):
                grown = np.empty(max(2 * n, 64), dtype=np.int64)
                grown[:have] = buf[:have]
                self._array = buf = grown
            buf[have:n] = ids[have:n]
        self._array_len = n
        view = buf[:n]
        view.flags.writeable = False
        return view

    def adopt_token_array(self, ids: np.ndarray) -> None:
        """Take `ids` (a new int64 array referenced nowhere else, whose first `len(token_ids)` entries equal
        `token_ids`; any past them are capacity for appends) as `token_array()`'s buffer: the conversion that call
        would make, already made (by the prompt check, `request_checks.prompt_array`)."""
        n = len(self.token_ids)
        assert ids.dtype == np.int64 and ids.ndim == 1 and len(ids) >= n
        self._array, self._array_src, self._array_len = ids, self.token_ids, n
        self.token_epoch += 1

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_remaining(self) -> int:
        """Tokens still to be fed to the model before the next sample (in-flight sampled tokens included)."""
        return len(self.token_ids) + self.num_pending - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status in (SequenceStatus.FINISHED, SequenceStatus.ABORTED)

    def position_offset(self, step: int) -> int:
        """Rotary position minus token index for a text token at `step` (or a resume at `step`): the sum of the
        offsets of the spans that end at or before it. Meaningful only outside spans."""
        return sum(span.position_delta for span in self.mm_spans if span.end <= step)

    def fit_chunk_to_spans(self, start: int, n: int) -> int:
        """`n` tokens from `start`, adjusted so the chunk never ends strictly inside a multimodal span: it ends at
        the span's start when that leaves a non-empty chunk, else at the span's end (an image is fed whole, even
        past the token budget)."""
        end = start + n
        for span in self.mm_spans:
            if span.start < end < span.end:
                return span.start - start if span.start > start else span.end - start
        return n

    def is_prefix_cache_boundary_safe(self, step: int) -> bool:
        """False when `step` falls strictly inside a multimodal span (no checkpoint or match may end there)."""
        return not any(span.start < step < span.end for span in self.mm_spans)
