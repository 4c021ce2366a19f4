"""Eviction order of the prefix cache: what keeping each checkpoint and trie leaf is expected to save.

Owns the priorities only (no resources): `StateCheckpointLifecycle` and `TrieKVLifecycle` keep their candidates in
`LazyMinHeap`s keyed by these priorities, and `BlockTrie` evicts the lowest one across them.

By value (the default), GreedyDual-Size-Frequency (Cherkasova 1998) with a sublinear saving, per byte of device
memory held:

    priority = L + max(1, hits) * floor(log2(1 + tokens)) / bytes

- `hits`: requests admitted on the item so far (restores of a checkpoint; matches through a dense-model block;
  a branch point starts with one). An item no request has used yet gets the credit of one use, and so does an
  item used once: one reuse is what every chat reply or repeated prompt gets, and it predicts nothing more. From
  the second hit on each hit adds credit. Observed reuse outlives an eviction: a checkpoint computed again inside
  a prompt, at the prefix of one evicted recently (the last 16K evictions are remembered), starts with that one's
  hits plus the hit the prompt missed (`StateCheckpointLifecycle.publish`; a ghost entry, as ARC and 2Q keep). A
  checkpoint computed past its prompt (a reply decoded again) would not have served that request and starts afresh.
- `tokens`: the prefill a hit skips (a checkpoint's step; for a dense block the `block_size` tokens it adds to its
  parent's prefix). Counted in bits (`floor(log2(1 + tokens))`): a deeper prefix saves more per hit but is shared
  by fewer later prompts, so a 4000-token one-off must not outrank a 200-token system prompt that serves every
  request; and items of the same magnitude tie, which leaves them to recency (the heap pops ties oldest first).
- `bytes`: the device memory the item frees (a checkpoint: state row, plus its frozen block if partial; kept logits
  live on the host; a block: one block).
- `L` (the clock): the priority of the last evicted item. It only grows, so credit earned long ago is worth less
  than fresh credit: observed reuse decays with eviction time.

A hybrid model's trie leaf is worth the most valuable checkpoint on it (evicting the leaf evicts them); a leaf with
no checkpoint left holds KV no hybrid match can use and goes first.

With `lru` the priority is the item's last access tick (plain least recently used, for comparison).
Cost: an O(log n) heap push per publish, hit, unpin or leaf change, and an O(log n) pop per eviction (amortised;
stale entries are skipped and compacted).
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar('T')

DEAD = -math.inf  # priority of an item that can serve no hit


class LazyMinHeap(Generic[T]):
    """Min-heap of items by priority with lazy invalidation: `push` supersedes an item's earlier entry and
    `discard` drops it; stale entries are skipped when popped. Ties go to the earlier push."""

    def __init__(self):
        self._heap: list[tuple[float, int, T]] = []
        self._live: dict[T, int] = {}   # item -> sequence number of its current entry
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, item: T) -> bool:
        return item in self._live

    def push(self, item: T, priority: float) -> None:
        seq = next(self._seq)
        self._live[item] = seq
        heapq.heappush(self._heap, (priority, seq, item))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [e for e in self._heap if self._live.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def discard(self, item: T) -> None:
        self._live.pop(item, None)

    def peek(self, eligible: Callable[[T], bool] | None = None) -> tuple[float, T] | None:
        """The lowest-priority live item that is `eligible` (all live items when None), left in the heap.
        Ineligible entries met on the way are kept."""
        skipped = []
        found = None
        while self._heap:
            priority, seq, item = self._heap[0]
            if self._live.get(item) != seq:
                heapq.heappop(self._heap)
                continue
            if eligible is None or eligible(item):
                found = (priority, item)
                break
            skipped.append(heapq.heappop(self._heap))
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return found

    def items(self) -> list[T]:
        return list(self._live)


class ReusePolicy:
    """Priorities of checkpoints and trie blocks (see the module docstring)."""

    def __init__(self, lru: bool = False):
        self.lru = lru
        self.clock = 0.0   # L: the priority of the last evicted item (by value)

    def priority(self, hits: int, tokens: int, nbytes: int, last_access: int) -> float:
        if self.lru:
            return float(last_access)
        return self.clock + max(1, hits) * math.floor(math.log2(1 + tokens)) / max(nbytes, 1)

    def touch(self, items: list, tokens: int, nbytes: int, now: int) -> None:
        """One more use at `now` of each of `items` (trie nodes of one size): `last_access`, `num_hits` and `priority`
        set as `priority` computes it (the same float operations in the same order), with the size's terms and the
        clock read once for the whole path, in one loop without a call per item (a 32K-token path is 512 nodes)."""
        if self.lru:
            value = float(now)
            for item in items:
                item.last_access = now
                item.num_hits += 1
                item.priority = value
            return
        clock, size, denom = self.clock, math.floor(math.log2(1 + tokens)), max(nbytes, 1)
        for item in items:
            hits = item.num_hits + 1  # >= 1: max(1, hits) is hits
            item.last_access = now
            item.num_hits = hits
            item.priority = clock + hits * size / denom

    def on_evicted(self, priority: float) -> None:
        if not self.lru and priority > self.clock:
            self.clock = priority
