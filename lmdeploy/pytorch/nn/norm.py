"""RMSNorm variants: plain, zero-centred (scale 1 + w), gated (w * norm(x) * silu(gate)), fused with the
residual stream's add (`RMSNorm(x, residual)`), and fused with the projection that reads the normed row
(`RMSNorm.linear`: the `cuda` backend runs a one-row norm and its GEMV as one launch)."""
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
        self._linear_impl = backend.build(OpType.RMSNormLinear)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual`, (norm(x + residual), x + residual) in one op (the sum in x's dtype)."""
        if residual is None:
            return self._impl(x, self.weight, self.eps, self.zero_centered)
        return self._add_impl(x, residual, self.weight, self.eps, self.zero_centered)

    def linear(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
               need_normed: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(`F.linear(h, weight)`, s, h) with s = x + residual (x itself when residual is None: the residual stream
        after the add) and h = this norm of s, for a projection that reads h (a plain weight: no bias, FP8 or LoRA,
        which the caller checks). h may be None unless `need_normed`; the product may differ from the two ops in
        sequence by a rounding (the fused kernel does not round h before the dot)."""
        return self._linear_impl(x, residual, self.weight, self.eps, self.zero_centered, weight,
                                 store_normed=need_normed)


class GatedRMSNorm(nn.Module):

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps
        self._impl = current_backend().build(OpType.GatedRMSNorm)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self._impl(x, gate, self.weight, self.eps)


def norm_residual(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(s), s) for the residual stream s = x + residual (x itself when residual is None): `RMSNorm.linear`'s
    first two steps alone, for a consumer it cannot fuse with."""
    if residual is None:
        return norm(x), x
    return norm(x, residual)
