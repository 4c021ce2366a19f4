"""Placing PEFT LoRA modules onto the engine's layers, and stacking every resident adapter per layer.

A PEFT module path names a module of the transformers model. It is placed on a LoRA-capable linear of ours:

- renamed like a base weight (`model.rename_weight`: e.g. Qwen3.5's `model.language_model.` -> `model.`);
- a projection the engine fuses (`q_proj`/`k_proj`/`v_proj` -> `qkv_proj`, `gate_proj`/`up_proj` ->
  `gate_up_proj`, Qwen3.5's `in_proj_qkv`/`in_proj_z` -> `in_proj_qkvz` and `in_proj_b`/`in_proj_a` ->
  `in_proj_ba`) becomes one output slice of the fused `MergedLinear` (the model's `stacked_params`);
- a module that is fused in the checkpoint too (Qwen3-Next's `in_proj_qkvz`) adapts every slice with the same A,
  its B rows converted like the base weight (`model.convert_weight`) and split by slice.

A module the engine cannot place (MoE experts, the router, embeddings, `lm_head`, vision or MTP weights, anything
outside the decoder layers, a name with no layer) is an error at start-up, never dropped: an adapter silently
missing some of its modules would serve different outputs than it was trained for.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..backends.selector import use_backend
from ..nn.blocked_fp8 import FP8_DTYPE
from ..nn.linear import Linear, MergedLinear
from ..nn.lora import LoRAStack
from .peft_adapter import PeftAdapter
from .weight_loading import ignored_reason

_NOT_ADAPTABLE = {'lm_head': 'lm_head', 'embed_tokens': 'embeddings'}
# Where LoRA-capable layers live (a model class may override with `lora_module_prefixes`): every row of their inputs
# is a token of the batch, which is what the per-row adapter slots index.
_DECODER_PREFIXES = ('model.layers.',)


class Placement(NamedTuple):
    """Where one checkpoint module's LoRA goes: `slices` of the linear at `module` (all of them when fused)."""
    module: str
    slices: tuple[int, ...]


def _fail(adapter: PeftAdapter, module: str, message: str) -> ValueError:
    return ValueError(f'adapter {adapter.name!r} ({adapter.path}): target module {module!r} {message}')


def _slices_of(layer: Linear) -> list[int]:
    return layer.shard_sizes if isinstance(layer, MergedLinear) else [layer.weight.size(0)]


def place_module(model: nn.Module, modules: dict[str, nn.Module], adapter: PeftAdapter, name: str) -> Placement:
    """The layer and slices `name` (a checkpoint module path) adapts; raises `ValueError` where there is none."""
    if '.experts.' in f'{name}.' or name.endswith('.experts'):
        raise _fail(adapter, name, 'is a MoE expert: LoRA on routed experts is not supported '
                    '(target attention, gated-delta and dense MLP projections)')
    leaf = name.rsplit('.', 1)[-1]
    if leaf in _NOT_ADAPTABLE:
        raise _fail(adapter, name, f'adapts the {_NOT_ADAPTABLE[leaf]}, which do not take LoRA here')
    rename = getattr(model, 'rename_weight', None)
    renamed = rename(f'{name}.weight') if rename is not None else f'{name}.weight'
    if renamed is None or ignored_reason(f'{name}.weight') is not None:
        raise _fail(adapter, name, 'belongs to weights the engine does not run (vision tower or MTP head)')
    path = renamed[:-len('.weight')]
    if not path.startswith(getattr(model, 'lora_module_prefixes', _DECODER_PREFIXES)):
        # e.g. the vision tower: its rows are image patches, not the tokens whose adapter slots a forward carries
        raise _fail(adapter, name, f'is outside the decoder layers ({path}); only the language model takes LoRA')
    layer = modules.get(path)
    if isinstance(layer, Linear):
        return Placement(path, tuple(range(len(_slices_of(layer)))))
    for fused, part, index in getattr(model, 'stacked_params', []):
        if path.endswith(f'.{part}') and isinstance(modules.get(path[:-len(part)] + fused), MergedLinear):
            return Placement(path[:-len(part)] + fused, (index,))
    kind = type(layer).__name__ if layer is not None else 'no layer'
    raise _fail(adapter, name, f'has no LoRA-capable linear in {type(model).__name__} (found {kind})')


def _module_weights(model: nn.Module, adapter: PeftAdapter, name: str, placement: Placement, layer: Linear
                    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """slice index -> (A [r, in], B [slice rows, r] times the scaling) for one checkpoint module."""
    lora = adapter.modules[name]
    sizes = _slices_of(layer)
    if lora.lora_a.size(1) != layer.weight.size(1):
        raise _fail(adapter, name, f'has lora_A {tuple(lora.lora_a.shape)} but the layer takes '
                    f'{layer.weight.size(1)} inputs')
    rows = sum(sizes[i] for i in placement.slices)
    if lora.lora_b.size(0) != rows:
        raise _fail(adapter, name, f'has lora_B {tuple(lora.lora_b.shape)} but the layer part has {rows} outputs')
    b = lora.lora_b.float() * lora.scaling
    convert = getattr(model, 'convert_weight', None)
    if convert is not None and len(placement.slices) > 1:  # fused in the checkpoint: rows laid out like its weight
        b = convert(f'{placement.module}.weight', b)
    pieces = b.split([sizes[i] for i in placement.slices])
    return {i: (lora.lora_a.float(), piece) for i, piece in zip(placement.slices, pieces)}


def attach_adapters(model: nn.Module, adapters: list[PeftAdapter], device_type: str) -> None:
    """Attach a `LoRAStack` to every layer any adapter targets; adapter k (in list order) takes slot k + 1."""
    modules = dict(model.named_modules())
    compute_dtype = next(p.dtype for p in model.parameters() if p.is_floating_point() and p.dtype != FP8_DTYPE)
    per_layer: dict[str, dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]] = {}
    for slot, adapter in enumerate(adapters, start=1):
        for name in adapter.modules:
            placement = place_module(model, modules, adapter, name)
            entries = per_layer.setdefault(placement.module, {})
            for i, pair in _module_weights(model, adapter, name, placement, modules[placement.module]).items():
                if (slot, i) in entries:
                    raise _fail(adapter, name, f'adapts a part of {placement.module!r} another module adapts too')
                entries[(slot, i)] = pair
    for path, entries in per_layer.items():
        layer = modules[path]
        sizes = _slices_of(layer)
        rank = max(a.size(0) for a, _ in entries.values())
        weight = layer.weight
        lora_a = torch.zeros(len(adapters) + 1, len(sizes) * rank, weight.size(1))
        lora_b = torch.zeros(len(adapters) + 1, weight.size(0), rank)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        for (slot, i), (a, b) in entries.items():
            lora_a[slot, i * rank:i * rank + a.size(0)] = a
            lora_b[slot, starts[i]:starts[i] + sizes[i], :b.size(1)] = b
        # an FP8 layer computes in the activation dtype, which its LoRA weights take
        dtype = weight.dtype if weight.dtype != FP8_DTYPE else compute_dtype
        with use_backend(device_type):
            layer.lora = LoRAStack(lora_a.to(weight.device, dtype), lora_b.to(weight.device, dtype), sizes)


class ResidentAdapter(NamedTuple):
    """A loaded adapter: its slot in every `LoRAStack` and its prefix-cache identity (name + digest)."""
    name: str
    slot: int
    identity: str
    rank: int
    path: str


def load_lora_adapters(model: nn.Module, paths: dict[str, str], device_type: str, max_loras: int,
                       max_lora_rank: int) -> dict[str, ResidentAdapter]:
    """Read, check and attach every adapter of `paths` (name -> PEFT folder); all stay resident.

    Raises `ValueError` at start-up for more adapters than `max_loras`, a rank above `max_lora_rank`, or a module
    that cannot be placed."""
    from .peft_adapter import load_peft_adapter
    if len(paths) > max_loras:
        raise ValueError(f'{len(paths)} adapters given but max_loras is {max_loras}; raise max_loras '
                         '(every adapter stays resident)')
    adapters = [load_peft_adapter(name, path) for name, path in paths.items()]
    for adapter in adapters:
        if adapter.rank > max_lora_rank:
            raise ValueError(f'adapter {adapter.name!r} ({adapter.path}) has rank {adapter.rank} but max_lora_rank '
                             f'is {max_lora_rank}; raise max_lora_rank')
    attach_adapters(model, adapters, device_type)
    return {a.name: ResidentAdapter(a.name, slot, a.identity, a.rank, a.path)
            for slot, a in enumerate(adapters, start=1)}
