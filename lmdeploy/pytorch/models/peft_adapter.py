"""Reading a PEFT LoRA folder (`adapter_config.json` + `adapter_model.safetensors`) into a validated record.

Only what the engine serves exactly is accepted: plain LoRA on linear layers, with `lora_alpha / r` or rsLoRA
(`lora_alpha / sqrt(r)`) scaling. Anything that would change the model in a way the LoRA op does not compute
(DoRA, bias terms, `modules_to_save`, per-module alpha, token or parameter targets) is refused with an error naming
the field, never skipped. The adapter's identity is its name plus a digest of its config and weights, so a
different adapter loaded under an old name never aliases the old one's prefix-cache entries.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
import xxhash
from safetensors import safe_open

CONFIG_FILE = 'adapter_config.json'
WEIGHTS_FILE = 'adapter_model.safetensors'
_PREFIX = 'base_model.model.'
_SUFFIXES = {'.lora_A.weight': 'A', '.lora_B.weight': 'B'}
# Config fields whose truthy value means the adapter computes something beyond plain LoRA.
_REFUSED_FIELDS = {
    'use_dora': 'DoRA (use_dora) is not supported',
    'use_qalora': 'QA-LoRA (use_qalora) is not supported',
    'alpha_pattern': 'per-module lora_alpha (alpha_pattern) is not supported',
    'modules_to_save': 'modules_to_save (fully trained copies of base modules) is not supported',
    'trainable_token_indices': 'trainable_token_indices is not supported',
    'target_parameters': 'target_parameters (LoRA on raw parameters, e.g. fused MoE experts) is not supported',
    'lora_bias': 'LoRA bias terms (lora_bias) are not supported',
    'fan_in_fan_out': 'fan_in_fan_out (Conv1D-style weights) is not supported',
}


@dataclass(frozen=True)
class LoRAModule:
    """One adapted module: `lora_a [r, in]`, `lora_b [out, r]` as saved, and the scaling applied to B."""
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.lora_a.size(0)


@dataclass(frozen=True)
class PeftAdapter:
    name: str
    path: str
    rank: int                      # the largest module rank
    modules: dict[str, LoRAModule]  # checkpoint module path (without `base_model.model.`) -> weights
    digest: str                    # xxh3-128 of the config and every tensor (name, dtype, shape, bytes)

    @property
    def identity(self) -> str:
        """Name plus digest: the adapter's key in the prefix cache."""
        return f'{self.name}@{self.digest}'


def _fail(name: str, path: str, message: str) -> ValueError:
    return ValueError(f'adapter {name!r} ({path}): {message}')


def read_adapter_config(name: str, path: str) -> dict:
    config_file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_file):
        raise _fail(name, path, f'not a PEFT adapter folder (no {CONFIG_FILE})')
    with open(config_file) as f:
        config = json.load(f)
    if str(config.get('peft_type', 'LORA')).upper() != 'LORA':
        raise _fail(name, path, f"only LoRA adapters are supported, got peft_type {config.get('peft_type')!r}")
    for field, message in _REFUSED_FIELDS.items():
        if config.get(field):
            raise _fail(name, path, message)
    if config.get('bias', 'none') != 'none':
        raise _fail(name, path, f"bias {config['bias']!r} is not supported (only 'none')")
    for field in ('r', 'lora_alpha'):
        if not isinstance(config.get(field), int | float) or config[field] <= 0:
            raise _fail(name, path, f'{field} must be a positive number, got {config.get(field)!r}')
    return config


def _read_tensors(name: str, path: str) -> dict[str, torch.Tensor]:
    weights_file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_file):
        raise _fail(name, path, f'no {WEIGHTS_FILE} (pickled adapter_model.bin is not loaded)')
    with safe_open(weights_file, framework='pt') as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}


def _digest(config: dict, tensors: dict[str, torch.Tensor]) -> str:
    h = xxhash.xxh3_128()
    h.update(json.dumps(config, sort_keys=True).encode())
    for key in sorted(tensors):
        t = tensors[key].contiguous()
        h.update(f'{key}|{t.dtype}|{tuple(t.shape)}'.encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b'')
    return h.hexdigest()


def _group_modules(name: str, path: str, tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        suffix = next((s for s in _SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            raise _fail(name, path, f'tensor {key!r} is not a LoRA A/B weight (unsupported adapter kind)')
        module = key[:-len(suffix)]
        module = module[len(_PREFIX):] if module.startswith(_PREFIX) else module
        grouped.setdefault(module, {})[_SUFFIXES[suffix]] = tensor
    return grouped


def load_peft_adapter(name: str, path: str) -> PeftAdapter:
    """Read and validate the PEFT LoRA folder `path`; raises `ValueError` naming the problem."""
    config = read_adapter_config(name, path)
    tensors = _read_tensors(name, path)
    if not tensors:
        raise _fail(name, path, f'{WEIGHTS_FILE} holds no tensors')
    modules = {}
    for module, pair in sorted(_group_modules(name, path, tensors).items()):
        if set(pair) != {'A', 'B'}:
            raise _fail(name, path, f'module {module!r} lacks lora_{"B" if "A" in pair else "A"}')
        a, b = pair['A'], pair['B']
        if a.ndim != 2 or b.ndim != 2 or a.size(0) != b.size(1):
            raise _fail(name, path, f'module {module!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} '
                        'are not [r, in] and [out, r]')
        rank = a.size(0)
        scaling = config['lora_alpha'] / (math.sqrt(rank) if config.get('use_rslora') else rank)
        modules[module] = LoRAModule(lora_a=a, lora_b=b, scaling=scaling)
    return PeftAdapter(name=name, path=path, rank=max(m.rank for m in modules.values()), modules=modules,
                       digest=_digest(config, tensors))
