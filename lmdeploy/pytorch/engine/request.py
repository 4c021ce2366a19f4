"""Records that cross the boundary between the engine and its callers."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


@dataclass
class EngineOutput:
    """Incremental output of one request after one engine step."""
    seq_id: int
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    # Prompt tokens served from the prefix cache.
    num_cached: int = 0
    logprobs: list[dict[int, float]] | None = None
    error: str | None = None
    # On the finished output of a request that asked: uint16 [num_tokens - 1, num_moe_layers, top_k].
    routed_experts: np.ndarray | None = None


OutputCallback = Callable[[EngineOutput], None]
