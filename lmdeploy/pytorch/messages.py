"""Hot per-request records shared by the scheduler, the inputs maker and the engine loop.

A `SchedulerSequence` is the engine's view of one request: its tokens, how many of them already have KV (and
recurrent state) computed, the blocks and state slot it owns, and its sampling parameters. Pure Python; no torch.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


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

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(frozen=True)
class MultiModalSpan:
    """Positions `[start, end)` hold embeddings of one multimodal item whose content hash is `content_hash`."""
    start: int
    end: int
    content_hash: int


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
    logprobs: list[dict[int, float]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_remaining(self) -> int:
        """Tokens still to be fed to the model before the next sample."""
        return len(self.token_ids) - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status in (SequenceStatus.FINISHED, SequenceStatus.ABORTED)

    def is_prefix_cache_boundary_safe(self, step: int) -> bool:
        """False when `step` falls strictly inside a multimodal span (no checkpoint or match may end there)."""
        return not any(span.start < step < span.end for span in self.mm_spans)
