"""Paged attention layer: writes the new tokens' K/V into the KV pool and attends over the cached context.

Given `cos_sin`, the layer applies neox rotary to q and k first (as `RotaryEmbedding.forward` does), and given
`qk_norm` it RMS-normalises every q and k head before that (as the models' `q_norm` / `k_norm` would), so a backend
can fuse norm, rotary and KV fill (the `cuda` backend does all three in one launch, K on its way into the pool).
Given `output_gate`, it returns the output times sigmoid(gate) (gated attention's output gate, rounded like
torch's `out * torch.sigmoid(gate)`; the `cuda` backend applies it inside a decode's merge launch)."""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..backends.base import OpType
from ..backends.selector import current_backend
from ..model_inputs import StepContext


class QKNorm(NamedTuple):
    """Per-head RMSNorm of q and k (weights [head_dim]), the `RMSNorm` modules' parameters."""
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
    zero_centered: bool


def qk_norm_of(q_norm: nn.Module, k_norm: nn.Module) -> QKNorm:
    """The `QKNorm` of two `nn.norm.RMSNorm` modules (same eps and kind)."""
    return QKNorm(q_norm.weight, k_norm.weight, q_norm.eps, q_norm.zero_centered)


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
                cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None, qk_norm: QKNorm | None = None,
                output_gate: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]; `qk_norm` normalises q and k heads, then `cos_sin`
        ([T, rotary_dim] each) rotates them; `output_gate` [T, Hq, D] gates the output."""
        k_cache, v_cache = ctx.kv_caches[self.cache_index]
        return self._impl(q, k, v, k_cache, v_cache, ctx.inputs, self.scale, cos_sin, qk_norm, output_gate)
