"""`EngineStats`: a frozen record of the engine's state at the end of one step, published once per step.

Built on the engine thread from cheap reads (queue lengths, free-list sizes, the prefix cache's O(1) `snapshot()`,
the vision-encoder cache's counters, the bytes of the routed experts the cache keeps) and swapped in as one
reference, so readers on other threads (`/metrics`, the benchmark, tests) never take a lock held by a step and never
see a step half done.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..paging.prefix_cache import PrefixCacheSnapshot
from .vision_cache import VisionCacheStats


@dataclass(frozen=True)
class SpecDecodeStats:
    """Counters since start (speculative decoding on). A verify row is a decode that fed drafts."""
    num_verify_rows: int = 0
    num_draft_tokens: int = 0     # drafts verified
    num_accepted_tokens: int = 0  # of those, accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify row emits on average: its accepted drafts plus the one the target gives."""
        return 1.0 + self.num_accepted_tokens / self.num_verify_rows if self.num_verify_rows else 0.0

    def as_dict(self) -> dict:
        return {'spec_verify_rows': self.num_verify_rows, 'spec_draft_tokens': self.num_draft_tokens,
                'spec_accepted_tokens': self.num_accepted_tokens, 'spec_acceptance_rate': self.acceptance_rate,
                'spec_mean_accepted_length': self.mean_accepted_length}


@dataclass(frozen=True)
class StepBatch:
    """The forward one step scheduled (all zero: the step ran none). A decode piece belongs to a sequence whose
    prompt is computed (it feeds sampled tokens only: one, plus its drafts with speculative decoding); every other
    piece is a prefill chunk. With async scheduling this is the forward the step launched, whose tokens the next
    step delivers."""
    num_seqs: int = 0         # sequences in the forward
    num_tokens: int = 0       # tokens they feed (drafts included)
    num_decode_seqs: int = 0  # of the sequences, decode pieces

    @property
    def is_pure_decode(self) -> bool:
        return self.num_seqs > 0 and self.num_decode_seqs == self.num_seqs


def step_batch(sched) -> StepBatch:
    """The batch of a `SchedulerOutput`, read before the step advances its sequences (`num_computed` still the
    position the piece starts at)."""
    decode = sum(seq.num_computed >= seq.num_prompt_tokens for seq in sched.seqs)
    return StepBatch(num_seqs=len(sched.seqs), num_tokens=sum(sched.num_new_tokens), num_decode_seqs=decode)


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
    # State rows only checkpoints use, and every row no running request holds (dummy and spare row excluded): how
    # many checkpoints fit (0 and 0 with prefix caching off or a dense model).
    checkpoint_rows: int = 0
    checkpoint_capacity: int = 0
    # Routed experts kept by the prefix cache (flag and caching on, else None): host bytes per cached token, in all.
    routed_experts_bytes_per_token: int | None = None
    routed_experts_cached_bytes: int | None = None
    # Speculative decoding's acceptance counters (None: speculation off).
    speculative: SpecDecodeStats | None = None
    # The forward this step scheduled (not in `as_dict`).
    batch: StepBatch = StepBatch()

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_kv_blocks / self.num_kv_blocks if self.num_kv_blocks else 0.0

    @property
    def state_usage(self) -> float:
        return 1.0 - self.num_free_state_slots / self.num_state_slots if self.num_state_slots else 0.0

    def as_dict(self) -> dict:
        """The flat dict of `Engine.stats`: prefix-cache counters and checkpoint rows, plus the vision cache's and the
        routed experts' when there are any."""
        out = self.prefix_cache.as_dict()
        out.update(checkpoint_rows=self.checkpoint_rows, checkpoint_capacity=self.checkpoint_capacity)
        if self.routed_experts_bytes_per_token is not None:
            out.update(routed_experts_bytes_per_token=self.routed_experts_bytes_per_token,
                       routed_experts_cached_bytes=self.routed_experts_cached_bytes)
        if self.speculative is not None:
            out.update(self.speculative.as_dict())
        if self.vision_cache is not None:
            v = self.vision_cache
            out.update(vision_cache_hits=v.hits, vision_cache_misses=v.misses, vision_cache_entries=v.entries,
                       vision_cache_bytes=v.bytes)
        return out


def collect_stats(step: int, scheduler, cache_config, vision_cache, routes, speculative: SpecDecodeStats | None,
                  batch: StepBatch = StepBatch()) -> EngineStats:
    """The record of the engine after `step` steps: the scheduler's queues and pools, the prefix cache's snapshot,
    the state rows checkpoints may use (`checkpoint_capacity`: the state slots less 2 and less the running
    sequences' rows), the vision cache's and the routed experts' figures where the engine has them, and the
    step's `batch`."""
    blocks, states = scheduler.block_manager, scheduler.state_manager
    rows = cache_config.num_state_slots if cache_config.prefix_cache is not None else 0
    running = sum(seq.state_slot is not None for seq in scheduler.running) if rows else 0
    record_routes = routes.record_all
    return EngineStats(step=step, num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
                       num_kv_blocks=blocks.num_blocks, num_free_kv_blocks=blocks.num_free,
                       num_state_slots=states.num_usable if states is not None else 0,
                       num_free_state_slots=states.num_free if states is not None else 0,
                       prefix_cache=scheduler.prefix_cache.snapshot(),
                       vision_cache=vision_cache.stats if vision_cache is not None else None,
                       checkpoint_rows=cache_config.prefix_cache.state_budget if rows else 0,
                       checkpoint_capacity=rows - 2 - running if rows else 0,
                       routed_experts_bytes_per_token=routes.bytes_per_token if record_routes else None,
                       routed_experts_cached_bytes=scheduler.trie.routes_bytes() if record_routes else None,
                       speculative=speculative, batch=batch)
