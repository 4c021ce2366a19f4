"""Index of published state checkpoints: exact key `(adapter, step, tail_hash)` plus vectorised prefilter arrays.

Finding candidates never walks the trie: a request's matched block path gives the set of anchor hashes it can
resume from; one vectorised pass over the live checkpoints (`np.isin` on anchor hashes, a step bound) yields the
candidates, deepest first. Each candidate is then confirmed by its exact key and by full verification in the
lifecycle (a hash never proves a hit).
"""
from __future__ import annotations

import numpy as np

from .node import NodeStateCheckpoint

_GROW = 256

IndexKey = tuple[str | None, int, int]


class StateCheckpointIndex:

    def __init__(self):
        self._by_key: dict[IndexKey, list[NodeStateCheckpoint]] = {}
        self._records: list[NodeStateCheckpoint | None] = []
        self._steps = np.zeros(0, dtype=np.int64)
        self._anchor_hashes = np.zeros(0, dtype=np.uint64)
        self._valid = np.zeros(0, dtype=bool)
        self._free_pos: list[int] = []
        # Adapter of each position, as a small integer code (None and names map to codes).
        self._adapter_codes = np.zeros(0, dtype=np.int64)
        self._codes: dict[str | None, int] = {None: 0}

    def __len__(self) -> int:
        return len(self._records) - len(self._free_pos)

    @staticmethod
    def key_of(ck: NodeStateCheckpoint) -> IndexKey:
        return (ck.adapter_name, ck.step, ck.tail_hash)

    def _grow(self) -> None:
        old = len(self._records)
        self._records.extend([None] * _GROW)
        self._steps = np.concatenate([self._steps, np.zeros(_GROW, dtype=np.int64)])
        self._anchor_hashes = np.concatenate([self._anchor_hashes, np.zeros(_GROW, dtype=np.uint64)])
        self._valid = np.concatenate([self._valid, np.zeros(_GROW, dtype=bool)])
        self._adapter_codes = np.concatenate([self._adapter_codes, np.zeros(_GROW, dtype=np.int64)])
        self._free_pos.extend(range(old + _GROW - 1, old - 1, -1))

    def add(self, ck: NodeStateCheckpoint) -> None:
        if not self._free_pos:
            self._grow()
        pos = self._free_pos.pop()
        code = self._codes.setdefault(ck.adapter_name, len(self._codes))
        self._records[pos] = ck
        self._steps[pos] = ck.step
        self._anchor_hashes[pos] = np.uint64(ck.anchor.hash)
        self._adapter_codes[pos] = code
        self._valid[pos] = True
        ck.index_pos = pos
        self._by_key.setdefault(self.key_of(ck), []).append(ck)

    def remove(self, ck: NodeStateCheckpoint) -> None:
        pos = ck.index_pos
        if pos is None:
            return
        self._valid[pos] = False
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

    def candidates(self, adapter_name: str | None, anchor_hashes: np.ndarray, max_step: int,
                   min_step: int = 1) -> list[NodeStateCheckpoint]:
        """Live checkpoints of `adapter_name` anchored on one of `anchor_hashes` with a step in
        `[min_step, max_step]`, deepest first."""
        code = self._codes.get(adapter_name)
        if code is None or not len(self):
            return []
        mask = self._valid & (self._adapter_codes == code) & (self._steps <= max_step) & (self._steps >= min_step)
        if not mask.any():
            return []
        positions = np.nonzero(mask)[0]
        positions = positions[np.isin(self._anchor_hashes[positions], anchor_hashes)]
        if not positions.size:
            return []
        order = np.argsort(-self._steps[positions], kind='stable')
        return [self._records[p] for p in positions[order]]
