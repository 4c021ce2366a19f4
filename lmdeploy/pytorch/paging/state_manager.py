"""Recurrent-state slot allocator for hybrid models.

Owns: which rows of the state pool are free. Row 0 is a reserved dummy that is never handed out (padding
entries of a batch point at it). Runtime slots (one per running sequence) and prefix-cache checkpoint slots are
drawn from the same free list; owners are tracked outside and verified by `check_integrity`.
"""
from __future__ import annotations

from collections import Counter


class StateManager:

    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise ValueError(f'a state pool needs at least 2 rows (row 0 is a dummy), got {num_slots}')
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, 0, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_slots - 1

    def allocate(self) -> int | None:
        """A free slot id, or None when the pool is exhausted."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise RuntimeError(f'free of state slot {slot} that is not allocated')
        self._used.remove(slot)
        self._free.append(slot)

    def check_integrity(self, owner_counts: Counter) -> None:
        """Every used slot has exactly one owner; free + used = usable rows; row 0 is never used."""
        owned = {slot for slot, count in owner_counts.items() if count}
        doubles = [slot for slot, count in owner_counts.items() if count > 1]
        if doubles:
            raise AssertionError(f'state slots owned twice: {doubles}')
        if owned != self._used:
            raise AssertionError(f'state slots used {sorted(self._used)} != owned {sorted(owned)}')
        if 0 in self._used or len(self._free) + len(self._used) != self.num_usable:
            raise AssertionError('state slot free list corrupt')
