"""Block-wise FP8 checkpoints: read `quantization_config`, validate the stored scales, and choose which layers keep
FP8 weights.

Format (the official `-FP8` releases, and transformers' `FineGrainedFP8Config`): `quant_method "fp8"`,
`weight_block_size [bn, bk]`, dynamic activation scales, and for every quantized weight `W [..., N, K]` stored as
float8_e4m3fn a float32 `weight_scale_inv [..., ceil(N / bn), ceil(K / bk)]` (real weight = W * scale_inv per block).
Modules in `modules_to_not_convert` are stored unquantized.

The plan runs on the model before its parameters are materialised. A layer (`Linear`, `MergedLinear`,
`FusedExperts`) keeps FP8 weights when FP8 compute is enabled (CUDA), none of the config's unquantized patterns names
it, every checkpoint tensor that feeds it is an FP8 weight, and its shards are whole blocks; every other FP8 weight
is dequantized at load. Validation runs on the safetensors headers, so a checkpoint with missing or mis-shaped
scales is refused before anything is read.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from ..nn.blocked_fp8 import FP8_DTYPE, scale_grid
from ..nn.linear import Linear, MergedLinear
from ..nn.moe import FusedExperts
from .checkpoint import TensorInfo
from .weight_loading import WeightRouter, ignored_reason, is_scale_name, scale_name_of, weight_name_of

# lm_head stays in the model dtype: `compute_logits` multiplies by its weight directly (transformers keeps it
# unquantized too).
_NEVER_FP8 = ('lm_head',)
_SCALE_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class BlockedFP8Config:
    block_size: tuple[int, int]
    modules_to_not_convert: tuple[str, ...] = ()

    def is_unquantized(self, module_name: str) -> bool:
        """transformers' matching rule: a pattern matches from the start up to a module boundary (also as a regex),
        or as a suffix."""
        boundary = r'(?:(?<=\.)|(?=\.|$))'
        return any(re.match(rf'(?:{p}){boundary}', module_name) or module_name.endswith(p)
                   for p in self.modules_to_not_convert)


def read_fp8_config(hf_config) -> BlockedFP8Config | None:
    """The checkpoint's FP8 settings, None for an unquantized checkpoint; unsupported schemes raise."""
    quant = getattr(hf_config, 'quantization_config', None)
    if quant is None:
        text = getattr(hf_config, 'text_config', None)
        quant = getattr(text, 'quantization_config', None) if text is not None else None
    if quant is None:
        return None
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    method = quant.get('quant_method')
    if method != 'fp8':
        raise NotImplementedError(f'quantization_config.quant_method {method!r} is not supported (only "fp8")')
    block = quant.get('weight_block_size')
    if not block or len(block) != 2 or min(block) <= 0:
        raise NotImplementedError(f'FP8 checkpoints need a block-wise weight_block_size [bn, bk], got {block!r} '
                                  '(per-tensor FP8 is not supported)')
    if quant.get('activation_scheme', 'dynamic') != 'dynamic':
        raise NotImplementedError(f"FP8 activation_scheme {quant['activation_scheme']!r} is not supported "
                                  '(only "dynamic")')
    if quant.get('fmt', 'e4m3') != 'e4m3' or quant.get('scale_fmt') not in (None, 'float32'):
        raise NotImplementedError('only e4m3 FP8 weights with float32 scales are supported')
    skip = quant.get('modules_to_not_convert') or quant.get('ignored_layers') or []
    return BlockedFP8Config((int(block[0]), int(block[1])), tuple(skip))


def validate_fp8_tensors(infos: dict[str, TensorInfo], config: BlockedFP8Config | None) -> None:
    """Every FP8 weight has a scale grid of the configured blocks and every scale an FP8 weight; raises
    `ValueError` naming each problem."""
    problems = []
    for name, info in infos.items():
        if is_scale_name(name):
            weight = infos.get(weight_name_of(name))
            if weight is None or weight.dtype != FP8_DTYPE:
                problems.append(f'{name}: a scale without an FP8 weight {weight_name_of(name)!r}')
            elif info.dtype not in _SCALE_DTYPES:
                problems.append(f'{name}: scale dtype {info.dtype} (expected float32)')
            continue
        if info.dtype != FP8_DTYPE:
            continue
        if config is None:
            problems.append(f'{name} is FP8, but config.json has no fp8 quantization_config')
            continue
        scale = infos.get(scale_name_of(name))
        expected = (*info.shape[:-2], *scale_grid(info.shape[-2], info.shape[-1], config.block_size))
        if scale is None:
            problems.append(f'{name}: FP8 weight without its {scale_name_of(name)!r}')
        elif scale.shape != expected:
            problems.append(f'{scale_name_of(name)}: shape {scale.shape}, expected {expected} for a weight of '
                            f'{info.shape} in blocks of {list(config.block_size)}')
    if problems:
        more = f' (and {len(problems) - 8} more)' if len(problems) > 8 else ''
        raise ValueError('invalid FP8 checkpoint: ' + '; '.join(problems[:8]) + more)


def _is_aligned(module: nn.Module, block_rows: int) -> bool:
    if isinstance(module, FusedExperts):
        return module.intermediate_size % block_rows == 0
    if isinstance(module, MergedLinear):
        return all(size % block_rows == 0 for size in module.shard_sizes)
    return True


def _sources(model: nn.Module, infos: dict[str, TensorInfo] | None) -> dict[str, list[tuple[str, bool]]]:
    """layer name -> [(checkpoint weight name, stored as FP8)] for every FP8-capable layer fed by the checkpoint; with
    no checkpoint (dummy weights) each layer stands for itself."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, Linear | FusedExperts)}
    if infos is None:
        return {name: [(name + '.weight', True)] for name in layers}
    router = WeightRouter(model, model.stacked_params)
    sources: dict[str, list[tuple[str, bool]]] = {}
    for name, info in infos.items():
        if is_scale_name(name) or name.endswith('.bias') or ignored_reason(name, router.modules.keys()) is not None:
            continue
        renamed = model.rename_weight(name)
        route = router.route(renamed) if renamed is not None else None
        if route is not None and route.module in layers:
            sources.setdefault(route.module, []).append((name, info.dtype == FP8_DTYPE))
    return sources


def plan_blocked_fp8(model: nn.Module, infos: dict[str, TensorInfo] | None, config: BlockedFP8Config | None,
                     enabled: bool) -> frozenset[str]:
    """Switch the layers that keep FP8 weights (see the module docstring); returns the checkpoint names of the FP8
    weights they take as they are. Call inside the backend scope, before the parameters are materialised."""
    if config is None or not enabled:
        return frozenset()
    kept: set[str] = set()
    for layer_name, feeds in _sources(model, infos).items():
        layer = model.get_submodule(layer_name)
        names = [name for name, _ in feeds]
        keep = (all(is_fp8 for _, is_fp8 in feeds)
                and not any(config.is_unquantized(n.rpartition('.')[0]) or config.is_unquantized(n) for n in names)
                and not config.is_unquantized(layer_name)
                and layer_name.rpartition('.')[2] not in _NEVER_FP8
                and _is_aligned(layer, config.block_size[0]))
        if keep:
            layer.use_blocked_fp8(config.block_size)
            kept.update(names)
    return frozenset(kept) if infos is not None else frozenset()
