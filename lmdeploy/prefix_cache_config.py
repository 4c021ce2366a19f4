"""`PrefixCacheConfig`: every prefix-cache knob in one frozen record (what each does: docs/prefix_caching.md).

`PytorchEngineConfig.prefix_cache` holds it; `PytorchEngineConfig` keeps accepting the flat `prefix_cache_*` names
and builds it from them when it is not given. The engine resolves it to the block size (`resolved`) and hands it down
in `CacheConfig.prefix_cache` to the scheduler's prefix cache and its checkpoint policy; nothing below re-threads the
knobs one by one.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

CHECKPOINT_MODES = ('exact', 'aligned')


def check_prefix_cache_knobs(values: dict, prefix: str = '') -> None:
    """`ValueError` naming the field (with `prefix`, as the caller spells it) for a knob out of range."""
    def require(cond: bool, message: str) -> None:
        if not cond:
            raise ValueError(message)

    def non_negative(name: str) -> None:
        value = values[name]
        require(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                f'{prefix}{name} must be a non-negative int, got {value!r}')

    non_negative('state_budget')
    ratio = values['state_ratio']
    require(isinstance(ratio, int | float) and not isinstance(ratio, bool) and 0 <= ratio < 1,
            f'{prefix}state_ratio must be in [0, 1), got {ratio!r}')
    require(values['checkpoint_mode'] in CHECKPOINT_MODES,
            f"{prefix}checkpoint_mode must be 'exact' or 'aligned', got {values['checkpoint_mode']!r}")
    for name in ('decode_state_interval', 'prefill_state_interval', 'prefill_state_cap'):
        non_negative(name)
    for name in ('reply_checkpoints', 'prompt_logits', 'branch_checkpoints', 'value_eviction'):
        require(isinstance(values[name], bool), f'{prefix}{name} must be a bool, got {values[name]!r}')


@dataclass(frozen=True)
class PrefixCacheConfig:
    # State rows only checkpoints use (hybrid models): exactly this many when positive, else `state_ratio` of the
    # cache memory when the KV pool is sized from memory (engine/cache_sizing.py).
    state_budget: int = 0
    state_ratio: float = 0.2
    # Where hybrid models keep state checkpoints: 'exact' (any safe step) or 'aligned' (block boundaries only).
    checkpoint_mode: str = 'exact'
    # Decode checkpoints (hybrid models): every this many tokens (a multiple of block_size); 0 = off.
    decode_state_interval: int = 0
    # Checkpoint policies (hybrid models), each switchable so benchmarks can show what it contributes:
    # keep the state after a finished request's prompt + reply (the next chat turn resends both);
    reply_checkpoints: bool = True
    # keep the last position's logits with prompt-end checkpoints (an identical prompt then skips its prefill);
    prompt_logits: bool = True
    # end a prefill chunk where a new prompt diverges from cached ones and checkpoint it (branch points);
    branch_checkpoints: bool = True
    # evict checkpoints by recency and compute saved per byte instead of plain LRU.
    value_eviction: bool = True
    # keep states inside long prefills at steps that are multiples of this many tokens (rounded up to a multiple of
    # block_size, so no frozen block is needed; 0 = off), at most `prefill_state_cap` per prompt and only in free
    # state rows (they never evict another checkpoint). Each one costs an extra recurrent-kernel call per recurrent
    # layer in that prefill (~4% of a cold 16K-token prefill on an H200, docs/prefix_caching.md), so the default is
    # twice the default prefill chunk: default chunks (8192 tokens, each ending in a checkpoint) never pay it,
    # larger chunks keep a state every 16384 tokens. A cut lies at least interval / 8 tokens from both ends of its
    # piece (a cut makes its forward eager; near an end it saves little), so short pieces take none.
    prefill_state_interval: int = 16384
    prefill_state_cap: int = 2

    def __post_init__(self):
        check_prefix_cache_knobs(self.as_dict())

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def exact_steps(self) -> bool:
        return self.checkpoint_mode == 'exact'

    def resolved(self, block_size: int) -> PrefixCacheConfig:
        """The knobs for a block size: the in-prefill interval rounded up to a block multiple. `ValueError` when the
        decode interval is not a multiple of the block size."""
        if self.decode_state_interval % block_size:
            raise ValueError(f'prefix_cache_decode_state_interval must be a non-negative multiple of block_size '
                             f'({block_size}), got {self.decode_state_interval!r}')
        interval = -(-self.prefill_state_interval // block_size) * block_size
        return self if interval == self.prefill_state_interval else replace(self, prefill_state_interval=interval)


# `PytorchEngineConfig` field name -> `PrefixCacheConfig` field name.
FLAT_NAMES = {f'prefix_cache_{f.name}': f.name for f in fields(PrefixCacheConfig)}
