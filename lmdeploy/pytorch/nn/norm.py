"""RMSNorm variants: plain, zero-centred (scale 1 + w), gated (w * norm(x) * silu(gate)), and fused with the
residual stream's add (`RMSNorm(x, residual)`)."""
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
        backend = current_backend()
        self._impl = backend.build(OpType.RMSNorm)
        self._add_impl = backend.build(OpType.AddRMSNorm)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual`, (norm(x + residual), x + residual) in one op (the sum in x's dtype)."""
        if residual is None:
            return self._impl(x, self.weight, self.eps, self.zero_centered)
        return self._add_impl(x, residual, self.weight, self.eps, self.zero_centered)


class GatedRMSNorm(nn.Module):

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps
        self._impl = current_backend().build(OpType.GatedRMSNorm)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self._impl(x, gate, self.weight, self.eps)
