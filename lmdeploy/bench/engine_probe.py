"""`EngineProbe`: what the prefix-cache benchmark reads from the engine, taken from its per-step statistics records
only (`Engine.stats_snapshot` and a step listener), never from the cache's internals."""
from __future__ import annotations


class EngineProbe:
    """What the report needs from the engine, from its per-step statistics records (`Engine.stats_snapshot`, and a
    step listener): matching cost, checkpoint memory, evictions, counter growth since the warm-up.

    `evictions()` runs on the engine loop thread (from output callbacks) and reads the previous step's record;
    `request_sample()` (also from a callback) makes the probe sample checkpoint memory from the record of the step
    that delivered the output, published once the step's bookkeeping (blocks attached, checkpoints published) is
    done: a step delivers its tokens before that bookkeeping.
    """

    def __init__(self, engine):
        self.engine = engine
        self.is_cache_enabled = engine.engine_config.enable_prefix_caching
        # Bytes of one checkpoint's state row and of its frozen partial block (kept logits are left out).
        self.row_bytes = engine.cache_config.state_row_bytes if engine.cache_config.num_state_slots else 0
        self.block_bytes = engine.cache_config.kv_block_bytes
        self.peak_bytes = 0
        # Peaks of KV blocks in use and of live checkpoints, over every step (the working set when unbounded).
        self.peak_blocks = self.peak_checkpoints = 0
        self.base = engine.stats_snapshot.prefix_cache
        self._sample_due = False
        engine.add_step_listener(self._on_step)

    def _on_step(self, stats) -> None:
        self.peak_blocks = max(self.peak_blocks, stats.num_kv_blocks - stats.num_free_kv_blocks)
        self.peak_checkpoints = max(self.peak_checkpoints, self.live_checkpoints(stats.prefix_cache))
        if self._sample_due:
            self._sample_due = False
            self._sample(stats.prefix_cache)

    def request_sample(self) -> None:
        self._sample_due = True

    def reset(self) -> None:
        """Start counting from here (after the warm-up; the engine must be idle)."""
        self.peak_bytes = 0
        self.peak_blocks = self.peak_checkpoints = 0
        self.engine.mark_stats()
        self.base = self.engine.stats_snapshot.prefix_cache

    @property
    def now(self):
        return self.engine.stats_snapshot.prefix_cache

    @property
    def match_s(self) -> float:
        return self.now.match_seconds - self.base.match_seconds

    @property
    def match_calls(self) -> int:
        return self.now.match_calls - self.base.match_calls

    def live_checkpoints(self, snapshot=None) -> int:
        """Checkpoints published since `reset()` and still live (the warm-up's are left out)."""
        return (snapshot or self.now).live_since_mark

    def checkpoint_bytes(self, snapshot=None) -> int:
        snapshot = snapshot or self.now
        return snapshot.live_since_mark * self.row_bytes + snapshot.partial_since_mark * self.block_bytes

    def _sample(self, snapshot) -> None:
        self.peak_bytes = max(self.peak_bytes, self.checkpoint_bytes(snapshot))

    def sample(self) -> None:
        self._sample(self.now)

    def evictions_by_cause(self) -> dict[str, int]:
        now, base = self.now.evictions_by_cause, self.base.evictions_by_cause
        return {cause: n - base.get(cause, 0) for cause, n in now.items() if n - base.get(cause, 0)}

    def stat_delta(self, key: str) -> int:
        """Growth of an engine counter since `reset()`."""
        return getattr(self.now, key) - getattr(self.base, key)

    def evictions(self) -> int:
        now = self.now
        return (now.evicted_checkpoints + now.evicted_blocks) - (self.base.evicted_checkpoints
                                                                 + self.base.evicted_blocks)
