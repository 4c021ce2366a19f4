"""Helpers that copy checkpoint tensors into model parameters, including fused (stacked) projections."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

# (fused param suffix, checkpoint suffix, shard index) - shards are concatenated along dim 0 in index order.
StackedMapping = list[tuple[str, str, int]]


def copy_param(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f'weight {name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}')
    param.data.copy_(tensor.to(param.dtype))


def copy_shard(param: torch.Tensor, tensor: torch.Tensor, shard_sizes: list[int], index: int, name: str) -> None:
    start = sum(shard_sizes[:index])
    target = param.data.narrow(0, start, shard_sizes[index])
    copy_param(target, tensor, name)


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], stacked: StackedMapping,
                 shard_sizes: dict[str, list[int]], rename=None, skip=None) -> set[str]:
    """Load `weights` into `model`; returns the set of parameter names that were written.

    `rename(name) -> name | None` maps checkpoint names onto model names (None drops the tensor);
    `shard_sizes[fused_suffix]` gives the dim-0 sizes of the stacked shards.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        name = rename(name) if rename else name
        if name is None or (skip and skip(name)):
            continue
        for fused, part, index in stacked:
            if name.endswith(f'.{part}.weight') or name.endswith(f'.{part}.bias'):
                target = name.replace(f'.{part}.', f'.{fused}.')
                if target in params:
                    copy_shard(params[target], tensor, shard_sizes[fused], index, name)
                    loaded.add(target)
                    break
        else:
            if name not in params:
                raise ValueError(f'unexpected checkpoint weight {name!r}')
            copy_param(params[name], tensor, name)
            loaded.add(name)
    return loaded
