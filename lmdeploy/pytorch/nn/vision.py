"""Layers of a ViT-style vision tower: bidirectional attention within each image with 2-D rotary, and the
per-forward packing record they share."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..backends.base import OpType
from ..backends.selector import current_backend
from .linear import Linear


@dataclass
class VisionBatch:
    """Packing of one vision forward: patches of attention unit b (one frame of one image) are rows
    `[cu_seqlens_list[b], cu_seqlens_list[b + 1])`; `cos`/`sin` [N, head_dim] are the 2-D rotary tables."""
    cu_seqlens: torch.Tensor
    cu_seqlens_list: list[int]
    max_seqlen: int
    cos: torch.Tensor
    sin: torch.Tensor


def rotate_half_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox rotary over the whole head dim, in float32: x [N, H, D], cos/sin [N, D]."""
    x32 = x.float()
    first, second = x32.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    return (x32 * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class VisionAttention(nn.Module):
    """Fused qkv projection (with bias), 2-D rotary on q and k, attention within each unit, output projection."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.qkv = Linear(dim, 3 * dim, bias=True)
        self.proj = Linear(dim, dim, bias=True)
        self._impl = current_backend().build(OpType.VisionAttention)

    def forward(self, x: torch.Tensor, batch: VisionBatch) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, self.head_dim)).unbind(1)
        q = rotate_half_neox(q, batch.cos, batch.sin)
        k = rotate_half_neox(k, batch.cos, batch.sin)
        out = self._impl(q, k, v.contiguous(), batch.cu_seqlens, batch.cu_seqlens_list, batch.max_seqlen,
                         self.scale)
        return self.proj(out.flatten(-2))
