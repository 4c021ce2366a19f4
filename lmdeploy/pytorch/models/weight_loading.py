"""Copy checkpoint tensors into model parameters: routing (fused projections, experts), strictness, FP8 pairing.

Order for every checkpoint tensor: known-ignorable prefixes are skipped (`IGNORED_CHECKPOINT_PREFIXES`) -> FP8
weights and their `weight_scale_inv` are paired and either kept (the target layer is FP8) or dequantized to the
model dtype -> the model renames it (`rename_weight`, None = drop) and converts its layout (`convert_weight`) ->
`WeightRouter` finds the parameter and copies it. A tensor no parameter takes, and a parameter no tensor wrote,
are errors that name them all (first few, and the count).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable
from typing import NamedTuple

import torch
from torch import nn

from ..nn.blocked_fp8 import FP8_DTYPE, check_fp8_copy, dequantize_blocked_fp8
from ..nn.linear import MergedLinear
from ..nn.moe import FusedExperts

logger = logging.getLogger('lmdeploy')

# Checkpoint tensors of optional parts, skipped unless the model built the module the prefix names (the MTP head
# exists only with speculative decoding on: `HybridForCausalLM.enable_mtp`). To support a new part, give the model
# the modules (and, where names differ, a `rename_weight` rule) that consume it. (The vision tower's `model.visual.*`
# left this list when Qwen3.5's vision tower landed.)
IGNORED_CHECKPOINT_PREFIXES: dict[str, str] = {
    'mtp.': 'multi-token-prediction head',
}

# (fused param suffix, checkpoint suffix, shard index) - shards are concatenated along dim 0 in index order.
StackedMapping = list[tuple[str, str, int]]
_PARAM_SUFFIXES = ('weight_scale_inv', 'weight', 'bias')
_MAX_LISTED = 8


def scale_name_of(weight_name: str) -> str:
    """The checkpoint name of a weight's block scales (transformers' rule: `x.weight` -> `x.weight_scale_inv`,
    fused experts `x.gate_up_proj` -> `x.gate_up_proj_scale_inv`)."""
    if weight_name.endswith('.weight'):
        return weight_name[:-len('weight')] + 'weight_scale_inv'
    return weight_name + '_scale_inv'


def weight_name_of(scale_name: str) -> str:
    if scale_name.endswith('.weight_scale_inv'):
        return scale_name[:-len('weight_scale_inv')] + 'weight'
    return scale_name[:-len('_scale_inv')]


def is_scale_name(name: str) -> bool:
    return name.endswith('_scale_inv')


def ignored_reason(name: str, built: Collection[str] = ()) -> str | None:
    """Why checkpoint tensor `name` is skipped, or None to load it; `built`: the model's submodule names (a prefix
    whose module is built, e.g. `mtp` with the MTP head on, loads)."""
    return next((why for prefix, why in IGNORED_CHECKPOINT_PREFIXES.items()
                 if name.startswith(prefix) and prefix.rstrip('.') not in built), None)


def _listed(names: Iterable[str]) -> str:
    names = sorted(names)
    more = f' ... and {len(names) - _MAX_LISTED} more' if len(names) > _MAX_LISTED else ''
    return f'{names[:_MAX_LISTED]}{more} ({len(names)} in all)'


class Route(NamedTuple):
    """Where one (renamed) checkpoint tensor goes. `module` is the owning layer's name."""
    module: str
    param: str | None = None          # parameter written (None for experts: the layer picks it from `key`)
    shard_index: int | None = None    # shard of a `MergedLinear`
    key: str | None = None            # key relative to a `FusedExperts`


class WeightRouter:
    """Maps model-namespace tensor names to parameters: experts -> their `FusedExperts`; shards of a stacked
    projection -> the `MergedLinear` that owns them (shard sizes come from that layer); the rest 1:1."""

    def __init__(self, model: nn.Module, stacked: StackedMapping):
        self.params = dict(model.named_parameters())
        self.modules = dict(model.named_modules())
        self.stacked = stacked

    def route(self, name: str) -> Route | None:
        prefix, sep, key = name.partition('.experts.')
        if sep and isinstance(self.modules.get(prefix + '.experts'), FusedExperts):
            return Route(prefix + '.experts', key=key)
        for fused, part, index in self.stacked:
            suffix = next((s for s in _PARAM_SUFFIXES if name.endswith(f'.{part}.{s}')), None)
            if suffix is None:
                continue
            module = name[:-len(f'{part}.{suffix}')] + fused
            target = f'{module}.{suffix}'
            if isinstance(self.modules.get(module), MergedLinear) and target in self.params:
                return Route(module, target, shard_index=index)
        if name in self.params:
            return Route(name.rpartition('.')[0], name)
        return None

    def write(self, route: Route, tensor: torch.Tensor, name: str) -> list[str]:
        """Copy `tensor` as routed; returns the pieces written (a parameter name, `param#shard` of a stacked
        projection, `param#expert.part` of per-expert weights), the units of `required_pieces`."""
        module = self.modules[route.module]
        if route.key is not None:
            written = module.load_weight(route.key, tensor)
            parts = route.key.split('.')
            if len(parts) == 3:  # per-expert `{e}.{proj}.{suffix}`
                return [f'{route.module}.{written[0]}#{parts[0]}.{parts[1]}']
            return [f'{route.module}.{p}#{e}.{part}' for p in written for e, part in self._expert_parts(module, p)]
        param = self.params[route.param]
        if route.shard_index is None:
            copy_param(param, tensor, name)
            return [route.param]
        sizes = module.shard_sizes
        if route.param.endswith('weight_scale_inv'):  # the scale grid of a shard is its rows in blocks
            sizes = [size // module.weight_block_size[0] for size in sizes]
        copy_shard(param, tensor, sizes, route.shard_index, name)
        return [f'{route.param}#{route.shard_index}']

    @staticmethod
    def _expert_parts(module: FusedExperts, param: str) -> list[tuple[int, str]]:
        projs = ('down_proj',) if param.startswith('down_proj') else ('gate_proj', 'up_proj')
        return [(e, proj) for e in range(module.num_experts) for proj in projs]

    def required_pieces(self) -> set[str]:
        """Every piece a complete load writes (see `write`)."""
        pieces = set()
        for name in self.params:
            module_name, _, param = name.rpartition('.')
            module = self.modules[module_name]
            if isinstance(module, FusedExperts):
                pieces.update(f'{name}#{e}.{part}' for e, part in self._expert_parts(module, param))
            elif isinstance(module, MergedLinear):
                pieces.update(f'{name}#{i}' for i in range(len(module.shard_sizes)))
            else:
                pieces.add(name)
        return pieces


def copy_param(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f'weight {name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}')
    check_fp8_copy(param, tensor, name)
    param.data.copy_(tensor.to(param.dtype))


def copy_shard(param: torch.Tensor, tensor: torch.Tensor, shard_sizes: list[int], index: int, name: str) -> None:
    start = sum(shard_sizes[:index])
    target = param.data.narrow(0, start, shard_sizes[index])
    copy_param(target, tensor, name)


class _FP8Pairs:
    """Holds an FP8 weight until its scales arrive (or the reverse), then dequantizes the pair."""

    def __init__(self, block_size: tuple[int, int] | None, dtype: torch.dtype):
        self.block_size = block_size
        self.dtype = dtype
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        if self.block_size is None:
            raise ValueError(f'checkpoint tensor {name!r} is FP8 / an FP8 scale, but config.json has no fp8 '
                             'quantization_config')
        weight_name = weight_name_of(name) if is_scale_name(name) else name
        entry = self.pending.setdefault(weight_name, {})
        entry['scale' if is_scale_name(name) else 'weight'] = tensor
        if len(entry) < 2:
            return None
        del self.pending[weight_name]
        try:
            return weight_name, dequantize_blocked_fp8(entry['weight'], entry['scale'], self.block_size, self.dtype)
        except ValueError as err:
            raise ValueError(f'{weight_name}: {err}') from None

    def check_empty(self) -> None:
        if self.pending:
            raise ValueError(f'FP8 weights or scales without their partner: {_listed(self.pending)}')


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], stacked: StackedMapping,
                 rename: Callable[[str], str | None] = lambda name: name,
                 convert: Callable[[str, torch.Tensor], torch.Tensor] = lambda name, tensor: tensor,
                 fp8_kept: frozenset[str] = frozenset(), fp8_block_size: tuple[int, int] | None = None) -> None:
    """Load every checkpoint tensor into `model` (see the module docstring); raises `ValueError` listing the
    tensors nothing consumed, or the parameters nothing wrote. `fp8_kept`: checkpoint names of FP8 weights whose
    layers stay FP8 (their scales load as parameters); every other FP8 weight is dequantized to its parameter's
    dtype with `fp8_block_size`."""
    router = WeightRouter(model, stacked)
    dtype = next((p.dtype for p in router.params.values() if p.dtype.is_floating_point and p.dtype != FP8_DTYPE),
                 torch.get_default_dtype())
    pairs = _FP8Pairs(fp8_block_size, dtype)
    loaded: set[str] = set()
    unexpected: list[str] = []
    ignored: dict[str, int] = {}
    for name, tensor in weights:
        reason = ignored_reason(name, router.modules.keys())
        if reason is not None:
            ignored[reason] = ignored.get(reason, 0) + 1
            continue
        is_fp8 = tensor.dtype == FP8_DTYPE or is_scale_name(name)
        if is_fp8 and (weight_name_of(name) if is_scale_name(name) else name) not in fp8_kept:
            paired = pairs.add(name, tensor)
            if paired is None:
                continue
            name, tensor = paired
        renamed = rename(name)
        if renamed is None:
            continue
        route = router.route(renamed)
        if route is None:
            unexpected.append(name)
            continue
        loaded.update(router.write(route, convert(renamed, tensor), name))
    pairs.check_empty()
    for reason, count in ignored.items():
        logger.info('skipped %d checkpoint tensors of the %s (not built)', count, reason)
    if unexpected:
        raise ValueError(f'checkpoint tensors the model does not use: {_listed(unexpected)}')
    # a stacked projection may also arrive whole (Qwen3-Next's in_proj_qkvz), covering all of its shards
    missing = {piece for piece in router.required_pieces() - loaded if piece.partition('#')[0] not in loaded}
    if missing:
        raise ValueError(f'model parameters the checkpoint does not provide: {_listed(missing)} '
                         '(`#i`: shard i of a stacked projection, `#e.proj`: expert e\'s proj)')
