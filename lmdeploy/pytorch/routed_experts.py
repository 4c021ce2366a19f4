"""Routed-experts rows of one sequence: for every position a forward ran (or a cache hit replayed), the expert ids
each MoE layer routed that token to. Pure numpy (the engine, the scheduler and the prefix cache all read it).

Row `p` is `uint16 [num_moe_layers, top_k]`, in MoE layer order (`ModelConfig.moe_layer_ids`) and the router's
top-k order. A sequence of `n` tokens that finished has rows `[0, n - 1)`: its last sampled token is never fed.
"""
from __future__ import annotations

import numpy as np

ROUTE_DTYPE = np.uint16


class RoutedExperts:
    """Rows for positions `[0, len(self))`, grown by doubling; written in position order.

    `write(start, rows)` replaces everything from `start` on (a recompute after a preemption, or rows replayed from
    the prefix cache, write over what was there), so the record always ends at the last position written.
    """

    __slots__ = ('_rows', '_len')

    def __init__(self, num_layers: int, top_k: int):
        self._rows = np.zeros((0, num_layers, top_k), dtype=ROUTE_DTYPE)
        self._len = 0

    @property
    def row_shape(self) -> tuple[int, int]:
        return self._rows.shape[1:]

    @property
    def row_bytes(self) -> int:
        """Bytes of one position's row (what one cached token costs to keep)."""
        return int(np.prod(self.row_shape)) * np.dtype(ROUTE_DTYPE).itemsize

    def __len__(self) -> int:
        return self._len

    def write(self, start: int, rows: np.ndarray) -> None:
        """Rows for positions `[start, start + len(rows))`; the record then ends there."""
        if not 0 <= start <= self._len:
            raise ValueError(f'routed experts: writing at position {start} leaves a gap (rows end at {self._len})')
        if rows.shape[1:] != self.row_shape:
            raise ValueError(f'routed experts: rows of shape {rows.shape[1:]}, expected {self.row_shape}')
        end = start + len(rows)
        if end > len(self._rows):
            grown = np.zeros((max(2 * end, 64), *self.row_shape), dtype=ROUTE_DTYPE)
            grown[:start] = self._rows[:start]
            self._rows = grown
        self._rows[start:end] = rows
        self._len = end

    def rows(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """A copy of the rows of positions `[start, stop)` (`stop` defaults to the end; it may not pass it)."""
        stop = self._len if stop is None else stop
        if not 0 <= start <= stop <= self._len:
            raise ValueError(f'routed experts: rows [{start}, {stop}) outside [0, {self._len})')
        return self._rows[start:stop].copy()
