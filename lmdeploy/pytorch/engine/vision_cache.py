"""The vision-encoder cache: merged image embeddings by content hash, LRU under a byte budget.

Owned by the `ModelAgent` (device memory). A content hash covers the preprocessed pixels, their dtype and shape and
the patch grid, so equal hashes mean equal tower inputs and hence equal embeddings: a hit skips the tower. An entry
larger than the whole budget is never kept. Not thread-safe: only the engine's step thread touches it.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import torch


class VisionCacheStats(NamedTuple):
    hits: int
    misses: int
    entries: int
    bytes: int
    max_bytes: int


class VisionEncoderCache:

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f'vision cache size must be >= 0 bytes, got {max_bytes}')
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, content_hash: int) -> torch.Tensor | None:
        """The cached embeddings (marked most recently used), or None; counts the hit or miss."""
        value = self._entries.get(content_hash)
        if value is None:
            self.misses += 1
            return None
        self._entries.move_to_end(content_hash)
        self.hits += 1
        return value

    def put(self, content_hash: int, embeds: torch.Tensor) -> None:
        """Keep `embeds` (evicting least recently used entries to fit); too large an entry is not kept."""
        size = embeds.numel() * embeds.element_size()
        if size > self.max_bytes or content_hash in self._entries:
            return
        while self._bytes + size > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()
        self._entries[content_hash] = embeds
        self._bytes += size

    @property
    def stats(self) -> VisionCacheStats:
        return VisionCacheStats(self.hits, self.misses, len(self._entries), self._bytes, self.max_bytes)
