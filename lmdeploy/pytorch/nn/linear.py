"""Linear layer whose matmul comes from the selected backend; weights in the model dtype or block-wise FP8
(`use_blocked_fp8`, see `blocked_fp8.py`); LoRA adapters attach to it (`nn.lora`)."""
from __future__ import annotations

import torch
from torch import nn

from ..backends.base import OpType
from ..backends.selector import current_backend
from .blocked_fp8 import fp8_parameter, scale_parameter


class Linear(nn.Module):

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.weight_scale_inv: nn.Parameter | None = None
        self.weight_block_size: tuple[int, int] | None = None  # set when the weight is block-wise FP8
        self._impl = current_backend().build(OpType.Linear)
        self.lora = None  # a `nn.lora.LoRAStack` once adapters are attached

    def use_blocked_fp8(self, block_size: tuple[int, int]) -> None:
        """Make `weight` FP8 with a `weight_scale_inv` block grid; call before the parameters are materialised."""
        self.weight_block_size = tuple(block_size)
        self.weight = fp8_parameter(self.weight)
        self.weight_scale_inv = scale_parameter(self.weight, self.weight_block_size)
        self._impl = current_backend().build(OpType.LinearBlockedF8, block_size=self.weight_block_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale_inv is not None:
            out = self._impl(x, self.weight, self.weight_scale_inv, self.bias)
        else:
            out = self._impl(x, self.weight, self.bias)
        return out if self.lora is None else self.lora(x, out)


class MergedLinear(Linear):
    """A linear layer whose output rows concatenate several checkpoint projections (`shard_sizes`, in order)."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool = False):
        super().__init__(in_features, sum(shard_sizes), bias)
        self.shard_sizes = list(shard_sizes)


class Embedding(nn.Module):

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self._impl = current_backend().build(OpType.Embedding)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self._impl(ids, self.weight)
