"""RMSNorm variants: plain, zero-centred (scale 1 + w) and gated (w * norm(x) * silu(gate))."""
from __future__ import annotations

import torch
from torch import nn

from ..backends.base import OpType
from ..backends.selector import current_backend


class RMSNorm(nn.Module):

    def __init__(self, hidden_size: int, eps: float = 1e-6, zero_centered: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps
        self.zero_centered = zero_centered
        self._impl = current_backend().build(OpType.RMSNorm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._impl(x, self.weight, self.eps, self.zero_centered)


class GatedRMSNorm(nn.Module):

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps
        self._impl = current_backend().build(OpType.GatedRMSNorm)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self._impl(x, gate, self.weight, self.eps)
