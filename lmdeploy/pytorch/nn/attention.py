"""Paged attention layer: writes the new tokens' K/V into the KV pool and attends over the cached context.

Given `cos_sin`, the layer applies neox rotary to q and k first (as `RotaryEmbedding.forward` does), so a backend
can fuse the rotary with the KV fill (the `cuda` backend rotates K on its way into the pool)."""
from __future__ import annotations

import torch
from torch import nn

from ..backends.base import OpType
from ..backends.selector import current_backend
from ..model_inputs import StepContext


class PagedAttention(nn.Module):

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, cache_index: int,
                 scale: float | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        # Position of this layer's (k, v) pair in `StepContext.kv_caches`.
        self.cache_index = cache_index
        self.scale = head_dim ** -0.5 if scale is None else scale
        self._impl = current_backend().build(OpType.PagedAttention)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext,
                cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]; `cos_sin` ([T, rotary_dim] each) rotates q and k first."""
        k_cache, v_cache = ctx.kv_caches[self.cache_index]
        return self._impl(q, k, v, k_cache, v_cache, ctx.inputs, self.scale, cos_sin)
