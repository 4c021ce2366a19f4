"""Linear layer whose matmul comes from the selected backend; LoRA adapters attach to it (`nn.lora`)."""
from __future__ import annotations

import torch
from torch import nn

from ..backends.base import OpType
from ..backends.selector import current_backend


class Linear(nn.Module):

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self._impl = current_backend().build(OpType.Linear)
        self.lora = None  # a `nn.lora.LoRAStack` once adapters are attached

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
