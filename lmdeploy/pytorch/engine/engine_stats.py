"""`EngineStats`: a frozen record of the engine's state at the end of one step, published once per step.

Built on the engine thread from O(1) reads (queue lengths, free-list sizes, the prefix cache's `snapshot()`, the
vision-encoder cache's counters) and swapped in as one reference, so readers on other threads (`/metrics`, the
benchmark, tests) never take a lock held by a step and never see a step half done.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..paging.prefix_cache import PrefixCacheSnapshot
from .vision_cache import VisionCacheStats


@dataclass(frozen=True)
class EngineStats:
    step: int                               # steps completed when this was published (0: before the first)
    num_running: int                        # requests in the running batch
    num_waiting: int                        # requests waiting to be scheduled
    num_kv_blocks: int                      # KV blocks in the pool
    num_free_kv_blocks: int                 # of those, on the free list
    num_state_slots: int                    # usable recurrent-state rows (0 for dense models)
    num_free_state_slots: int
    prefix_cache: PrefixCacheSnapshot       # all zero with prefix caching off
    vision_cache: VisionCacheStats | None   # None without a vision tower

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_kv_blocks / self.num_kv_blocks if self.num_kv_blocks else 0.0

    @property
    def state_usage(self) -> float:
        return 1.0 - self.num_free_state_slots / self.num_state_slots if self.num_state_slots else 0.0

    def as_dict(self) -> dict:
        """The flat dict of `Engine.stats`: prefix-cache counters, plus the vision cache's when there is one."""
        out = self.prefix_cache.as_dict()
        if self.vision_cache is not None:
            v = self.vision_cache
            out.update(vision_cache_hits=v.hits, vision_cache_misses=v.misses, vision_cache_entries=v.entries,
                       vision_cache_bytes=v.bytes)
        return out
