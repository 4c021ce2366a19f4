"""Helpers that copy checkpoint tensors into model parameters, including fused (stacked) projections."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..nn.linear import MergedLinear
from ..nn.moe import FusedExperts

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


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], stacked: StackedMapping
                 ) -> set[str]:
    """Copy checkpoint tensors into `model`; returns the names of the parameters written.

    Three routes: expert weights go to their `FusedExperts` (per-expert or fused keys); shards of a stacked
    projection go into the `MergedLinear` that owns them (shard sizes come from that layer); the rest copy 1:1.
    """
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    for name, tensor in weights:
        prefix, sep, key = name.partition('.experts.')
        if sep and isinstance(modules.get(prefix + '.experts'), FusedExperts):
            written = modules[prefix + '.experts'].load_weight(key, tensor)
            loaded.update(f'{prefix}.experts.{p}' for p in written)
            continue
        for fused, part, index in stacked:
            suffix = next((s for s in ('weight', 'bias') if name.endswith(f'.{part}.{s}')), None)
            if suffix is None:
                continue
            target = name[:-len(f'{part}.{suffix}')] + f'{fused}.{suffix}'
            owner = modules.get(target.rsplit('.', 1)[0])
            if target in params and isinstance(owner, MergedLinear):
                copy_shard(params[target], tensor, owner.shard_sizes, index, name)
                loaded.add(target)
                break
        else:
            if name not in params:
                raise ValueError(f'unexpected checkpoint weight {name!r}')
            copy_param(params[name], tensor, name)
            loaded.add(name)
    return loaded
