"""Gated activations."""
from __future__ import annotations

import torch
from torch import nn

from ..backends.base import OpType
from ..backends.selector import current_backend


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:] for a fused gate/up projection of width 2d."""

    def __init__(self):
        super().__init__()
        self._impl = current_backend().build(OpType.SiluAndMul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._impl(x)
