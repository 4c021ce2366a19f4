"""KV block allocator: logical block ids with reference counts.

Owns: the free list and the ref count of every logical KV block. It does not know who the owners are (requests,
the prefix trie, checkpoints); each owner holds exactly one reference per block it owns, and
`check_integrity(owner_counts)` verifies that bookkeeping from the outside.

A logical block is `block_size` tokens = `pages_per_block` contiguous kernel pages of the packed KV pool.
`resolve_gpu_block_offsets` is the single place where logical ids become physical offsets (copy plans and block
tables go through it).
"""
from __future__ import annotations

from collections import Counter, deque

import numpy as np

# Id lists at least this long take one numpy pass in add_ref / free (a request's block path); shorter ones, a loop.
_VECTOR_MIN = 16


class BlockManager:

    def __init__(self, num_blocks: int, pages_per_block: int = 1):
        if num_blocks <= 0:
            raise ValueError(f'num_blocks must be positive, got {num_blocks}')
        self.num_blocks = num_blocks
        self.pages_per_block = pages_per_block
        self._ref_counts = np.zeros(num_blocks, dtype=np.int64)
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, num: int) -> bool:
        return num <= len(self._free)

    def allocate(self, num: int) -> list[int]:
        """Take `num` free blocks (ref count 1 each). Raises `MemoryError` when short; allocates nothing then."""
        if num > len(self._free):
            raise MemoryError(f'need {num} KV blocks, {len(self._free)} free')
        ids = [self._free.popleft() for _ in range(num)]
        self._ref_counts[ids] = 1
        return ids

    def add_ref(self, block_ids: list[int]) -> None:
        """One more reference per id (an id twice: two). Raises if one of them is free (a long list: changing
        nothing)."""
        if len(block_ids) >= _VECTOR_MIN:  # a request's path of blocks: one numpy pass instead of an element each
            ids = np.asarray(block_ids, dtype=np.intp)
            counts = self._ref_counts[ids]
            if (counts <= 0).any():
                raise RuntimeError(f'add_ref on free block {int(ids[np.argmax(counts <= 0)])}')
            np.add.at(self._ref_counts, ids, 1)
            return
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise RuntimeError(f'add_ref on free block {block_id}')
            self._ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference per id; blocks whose count reaches zero return to the free list, in the order their
        counts reach it. Raises on a double free (a long list: changing nothing)."""
        if len(block_ids) >= _VECTOR_MIN:
            ids = np.asarray(block_ids, dtype=np.intp)
            np.subtract.at(self._ref_counts, ids, 1)
            after = self._ref_counts[ids]
            if (after < 0).any():
                bad = int(ids[np.argmax(after < 0)])
                np.add.at(self._ref_counts, ids, 1)
                raise RuntimeError(f'double free of block {bad}')
            freed = ids[after == 0].tolist()
            if len(set(freed)) < len(freed):  # an id given twice reaches zero at its last occurrence only
                last = {block_id: i for i, block_id in enumerate(freed)}
                freed = [block_id for i, block_id in enumerate(freed) if last[block_id] == i]
            self._free.extend(freed)
            return
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count <= 0:
                raise RuntimeError(f'double free of block {block_id}')
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free.append(block_id)

    def ref_count(self, block_id: int) -> int:
        return int(self._ref_counts[block_id])

    def resolve_gpu_block_offsets(self, block_ids: list[int] | np.ndarray) -> np.ndarray:
        """Validate allocated logical ids and return their physical block offsets (int64)."""
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_blocks):
            raise ValueError(f'block id out of range [0, {self.num_blocks}): {ids.tolist()}')
        if ids.size and (self._ref_counts[ids] <= 0).any():
            raise ValueError(f'block ids not allocated: {ids[self._ref_counts[ids] <= 0].tolist()}')
        return ids.copy()

    def check_integrity(self, owner_counts: Counter) -> None:
        """Assert that every block's ref count equals the number of owners that claim it, and free == count 0."""
        expected = np.zeros(self.num_blocks, dtype=np.int64)
        for block_id, count in owner_counts.items():
            expected[block_id] = count
        mismatch = np.nonzero(expected != self._ref_counts)[0]
        if mismatch.size:
            details = [(int(b), int(self._ref_counts[b]), int(expected[b])) for b in mismatch[:8]]
            raise AssertionError(f'KV ref counts (block, actual, owners) disagree: {details}')
        free = sorted(self._free)
        zero = np.nonzero(self._ref_counts == 0)[0].tolist()
        if free != zero:
            raise AssertionError(f'free list {free[:16]} != zero-ref blocks {zero[:16]}')
