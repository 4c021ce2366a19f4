"""Index of published state checkpoints: exact key `(adapter, step, tail_hash)` plus vectorised prefilter arrays.

Finding candidates never walks the trie: every checkpoint records prefix hashes of its own tokens (prefix_keys.py):
up to the last hash-chunk boundary before its step, and of the few tokens from there to the step. One vectorised
pass over the live checkpoints keeps those of the adapter within the step bound whose chunk hash equals the
request's at that boundary, and then those whose remainder hash equals the request's (computed once per chunk that
still has candidates). The survivors come back deepest first; the caller verifies each exactly (a hash never
proves a hit). The exact key serves duplicate detection.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .node import NodeStateCheckpoint

_GROW = 256
# Step stored at an empty position: above any step bound, so empty positions never pass the filter.
_EMPTY = np.iinfo(np.int64).max

IndexKey = tuple[str | None, int, int]


class StateCheckpointIndex:

    def __init__(self, stride: int):
        self.stride = stride
        self._by_key: dict[IndexKey, list[NodeStateCheckpoint]] = {}
        self._records: list[NodeStateCheckpoint | None] = []
        self._free_pos: list[int] = []
        # Per position: step (_EMPTY when free) = chunk * stride + rem, prefix hash up to the chunk boundary and of
        # the rem tokens after it, adapter code (None and names map to small integers).
        self._steps = np.zeros(0, dtype=np.int64)
        self._chunks = np.zeros(0, dtype=np.int64)
        self._rems = np.zeros(0, dtype=np.int64)
        self._chunk_hashes = np.zeros(0, dtype=np.uint64)
        self._tail_hashes = np.zeros(0, dtype=np.uint64)
        self._adapter_codes = np.zeros(0, dtype=np.int64)
        self._codes: dict[str | None, int] = {None: 0}
        self._num_by_code: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._records) - len(self._free_pos)

    @staticmethod
    def key_of(ck: NodeStateCheckpoint) -> IndexKey:
        return (ck.adapter_name, ck.step, ck.tail_hash)

    def _grow(self) -> None:
        old = len(self._records)
        self._records.extend([None] * _GROW)
        self._steps = np.concatenate([self._steps, np.full(_GROW, _EMPTY, dtype=np.int64)])
        self._chunks = np.concatenate([self._chunks, np.zeros(_GROW, dtype=np.int64)])
        self._rems = np.concatenate([self._rems, np.zeros(_GROW, dtype=np.int64)])
        self._chunk_hashes = np.concatenate([self._chunk_hashes, np.zeros(_GROW, dtype=np.uint64)])
        self._tail_hashes = np.concatenate([self._tail_hashes, np.zeros(_GROW, dtype=np.uint64)])
        self._adapter_codes = np.concatenate([self._adapter_codes, np.zeros(_GROW, dtype=np.int64)])
        self._free_pos.extend(range(old + _GROW - 1, old - 1, -1))

    def add(self, ck: NodeStateCheckpoint) -> None:
        if not self._free_pos:
            self._grow()
        pos = self._free_pos.pop()
        code = self._codes.setdefault(ck.adapter_name, len(self._codes))
        self._records[pos] = ck
        self._steps[pos] = ck.step
        self._chunks[pos], self._rems[pos] = divmod(ck.step, self.stride)
        self._chunk_hashes[pos] = np.uint64(ck.chunk_hash)
        self._tail_hashes[pos] = np.uint64(ck.tail_sum)
        self._adapter_codes[pos] = code
        self._num_by_code[code] = self._num_by_code.get(code, 0) + 1
        ck.index_pos = pos
        self._by_key.setdefault(self.key_of(ck), []).append(ck)

    def remove(self, ck: NodeStateCheckpoint) -> None:
        pos = ck.index_pos
        if pos is None:
            return
        self._steps[pos] = _EMPTY
        self._num_by_code[int(self._adapter_codes[pos])] -= 1
        self._records[pos] = None
        self._free_pos.append(pos)
        ck.index_pos = None
        bucket = self._by_key.get(self.key_of(ck), [])
        if ck in bucket:
            bucket.remove(ck)
        if not bucket:
            self._by_key.pop(self.key_of(ck), None)

    def lookup(self, key: IndexKey) -> list[NodeStateCheckpoint]:
        return self._by_key.get(key, [])

    def candidates(self, adapter_name: str | None, chunk_hashes: np.ndarray,
                   tail_hashes: Callable[[np.ndarray, np.ndarray], np.ndarray], max_step: int
                   ) -> list[NodeStateCheckpoint]:
        """Live checkpoints of `adapter_name` with a step in `[1, max_step]` whose hashes equal the request's:
        `chunk_hashes[chunk]` up to the chunk boundary, then `tail_hashes(chunks, rems)` after it; deepest first.
        `max_step` must not exceed the request's length."""
        code = self._codes.get(adapter_name)
        if code is None or not self._num_by_code.get(code):
            return []
        mask = self._steps <= max_step
        if self._num_by_code[code] < len(self):
            mask &= self._adapter_codes == code
        mask &= chunk_hashes[np.minimum(self._chunks, len(chunk_hashes) - 1)] == self._chunk_hashes
        positions = np.flatnonzero(mask)
        if positions.size:
            same = tail_hashes(self._chunks[positions], self._rems[positions]) == self._tail_hashes[positions]
            positions = positions[same]
        if not positions.size:
            return []
        order = np.argsort(-self._steps[positions], kind='stable')
        return [self._records[p] for p in positions[order]]
