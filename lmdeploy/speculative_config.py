"""`SpeculativeConfig`: speculative decoding settings, carried as `PytorchEngineConfig.speculative_config`.

LMDeploy's names: `method` (CLI `--speculative-algorithm`) and `num_speculative_tokens` (CLI
`--speculative-num-draft-tokens`, K: draft tokens proposed, and verified by one target forward, per step). The one
method here is 'mtp': the checkpoint's own multi-token-prediction head (`mtp.*`, Qwen3.5 / Qwen3-Next) drafts.
"""
from __future__ import annotations

from dataclasses import dataclass

SPECULATIVE_METHODS = ('mtp',)
MAX_DRAFT_TOKENS = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = 'mtp'
    num_speculative_tokens: int = 1

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f'speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}')
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_DRAFT_TOKENS:
            raise ValueError(f'num_speculative_tokens (--speculative-num-draft-tokens) must be an int in '
                             f'[1, {MAX_DRAFT_TOKENS}], got {k!r}')
