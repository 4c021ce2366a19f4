"""Gated activations."""
from __future__ import annotations

import torch
from torch import nn

from ..backends.base import OpType
from ..backends.selector import current_backend
from .linear import Linear, MergedLinear, fusable
from .norm import RMSNorm, norm_residual


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:] for a fused gate/up projection of width 2d."""

    def __init__(self):
        super().__init__()
        self._impl = current_backend().build(OpType.SiluAndMul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._impl(x)


class GatedMLP(nn.Module):
    """SwiGLU MLP with a fused gate/up projection (`gate_up_proj` shards: gate, up)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size])
        self.down_proj = Linear(intermediate_size, hidden_size)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward(h), s) for h = norm(s), s = x + residual (`RMSNorm.linear`: the norm and `gate_up_proj` in one
        op while that projection is a plain weight)."""
        if fusable(self.gate_up_proj):
            gate_up, residual, _ = norm.linear(x, residual, self.gate_up_proj.weight)
            return self.down_proj(self.act(gate_up)), residual
        h, residual = norm_residual(norm, x, residual)
        return self(h), residual
