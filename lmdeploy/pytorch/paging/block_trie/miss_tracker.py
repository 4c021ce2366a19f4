"""Miss attribution: why prompt tokens were not served from the cache.

Owns bounded memories of what the cache *used to* hold or *could not* take, all by block prefix key
(prefix_keys.py: the request computes them in one vectorised pass): evicted trie blocks, and the anchors of evicted
checkpoints and of checkpoints skipped for lack of a slot or block. `attribute` splits a request's uncached prompt
tokens into reasons; every uncached token gets exactly one:

- `novel`: no earlier request had these tokens (not a cache miss; the oracle has no hit there either);
- `evicted`: the blocks or a checkpoint covering them were evicted;
- `capacity`: a checkpoint there was wanted but could not be reserved (no free slot or block);
- `multimodal`: the resume step would fall strictly inside a multimodal span;
- `adapter`: the tokens are cached under another adapter;
- `no_checkpoint`: the tokens are cached (KV) but no state checkpoint exists at a usable step;
- `routes_missing`: a request that records routed experts would resume there, but the cache holds no routes for
  some of the skipped positions (route_store.py), so it resumes at the deepest point whose routes it has.
"""
from __future__ import annotations

from collections import Counter, OrderedDict

REASONS = ('novel', 'evicted', 'capacity', 'multimodal', 'adapter', 'no_checkpoint', 'routes_missing')
_MAX_ENTRIES = 1 << 16


class _BoundedSet:

    def __init__(self, capacity: int = _MAX_ENTRIES):
        self._items: OrderedDict = OrderedDict()
        self._capacity = capacity

    def add(self, item) -> None:
        self._items[item] = None
        self._items.move_to_end(item)
        if len(self._items) > self._capacity:
            self._items.popitem(last=False)

    def discard(self, item) -> None:
        self._items.pop(item, None)

    def __contains__(self, item) -> bool:
        return item in self._items

    def contains_any(self, items) -> bool:
        return any(map(self._items.__contains__, items))


class MissTracker:

    def __init__(self):
        self.evicted_blocks = _BoundedSet()
        self.evicted_checkpoints = _BoundedSet()   # anchor keys that lost a checkpoint to eviction
        self.skipped_checkpoints = _BoundedSet()   # anchor keys where a wanted checkpoint was not affordable
        self.totals: Counter = Counter()

    def note_evicted_block(self, prefix_key: int) -> None:
        self.evicted_blocks.add(prefix_key)

    def note_attached_block(self, prefix_key: int) -> None:
        self.evicted_blocks.discard(prefix_key)

    def note_evicted_checkpoint(self, anchor_key: int) -> None:
        self.evicted_checkpoints.add(anchor_key)

    def note_skipped_checkpoint(self, anchor_key: int) -> None:
        self.skipped_checkpoints.add(anchor_key)

    def attribute(self, num_prompt: int, hit: int, covered: int, evicted_until: int, mm_limited: int,
                  gap_anchors: list[int], other_adapter: int, routes_limited: int = 0) -> Counter:
        """Reasons for the prompt tokens `[hit, num_prompt)`.

        `covered`: tokens present in the trie (blocks and checkpoint tails); `evicted_until`: the end of a run of
        evicted blocks right after `covered` (== covered when none); `mm_limited`: the deepest verified step that
        was rejected for falling inside a multimodal span (0 when none); `gap_anchors`: keys of the nodes that
        anchor steps in `(hit, covered]`, looked up in the eviction / skip memories; `other_adapter`: tokens cached
        under another adapter; `routes_limited`: the deepest verified step rejected because its routed experts
        cannot be replayed (0 when none).
        """
        reasons: Counter = Counter()
        cached_end = max(covered, hit)
        for reason, limit in (('multimodal', mm_limited), ('routes_missing', routes_limited)):
            if limit > hit:
                reasons[reason] += limit - hit
                hit = limit
        if cached_end > hit:
            reason = 'no_checkpoint'
            if self.evicted_checkpoints.contains_any(gap_anchors):
                reason = 'evicted'
            elif self.skipped_checkpoints.contains_any(gap_anchors):
                reason = 'capacity'
            reasons[reason] += cached_end - hit
        rest = num_prompt - cached_end
        evicted = min(max(evicted_until - cached_end, 0), rest)
        if evicted:
            reasons['evicted'] += evicted
            rest -= evicted
        adapter = min(max(other_adapter - cached_end, 0), rest)
        if adapter:
            reasons['adapter'] += adapter
            rest -= adapter
        if rest > 0:
            reasons['novel'] += rest
        self.totals.update(reasons)
        return reasons
