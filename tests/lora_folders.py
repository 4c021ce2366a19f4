"""Hand-written PEFT LoRA folders for tests (peft's file names and key layout, random A and B)."""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file


def write_adapter(path, modules: dict[str, tuple[int, int]], rank: int = 4, prefix: str = 'base_model.model.',
                  seed: int = 0, **config) -> str:
    """modules: checkpoint module path -> (in, out); B and A random."""
    os.makedirs(path, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (fan_in, fan_out) in modules.items():
        tensors[f'{prefix}{module}.lora_A.weight'] = torch.randn(rank, fan_in, generator=gen)
        tensors[f'{prefix}{module}.lora_B.weight'] = torch.randn(fan_out, rank, generator=gen)
    save_file(tensors, os.path.join(path, 'adapter_model.safetensors'))
    cfg = dict(peft_type='LORA', r=rank, lora_alpha=2 * rank, target_modules=sorted({m.rsplit('.', 1)[-1]
                                                                                    for m in modules}))
    cfg.update(config)
    with open(os.path.join(path, 'adapter_config.json'), 'w') as f:
        json.dump(cfg, f)
    return str(path)


def write_model_adapter(path, model_path: str, targets: list[str], rank: int = 4, seed: int = 0, **config) -> str:
    """An adapter on every module of the checkpoint at `model_path` whose name ends in one of `targets` (in and out
    sizes read from the checkpoint), with A scaled by 1/sqrt(in) and B by 1/4: large deltas, yet logits in a range
    where float32 warm and cold runs agree to 1e-4."""
    from safetensors import safe_open
    modules = {}
    with safe_open(os.path.join(model_path, 'model.safetensors'), framework='pt') as handle:
        for key in handle.keys():
            module, _, leaf = key.rpartition('.')
            if leaf == 'weight' and module.rsplit('.', 1)[-1] in targets:
                out_features, in_features = handle.get_slice(key).get_shape()
                modules[module] = (in_features, out_features)
    path = write_adapter(path, modules, rank=rank, seed=seed, **config)
    from safetensors.torch import load_file
    weights_file = os.path.join(path, 'adapter_model.safetensors')
    tensors = load_file(weights_file)
    for key, t in tensors.items():
        if key.endswith('lora_A.weight'):
            t.div_(t.size(1) ** 0.5)
        else:
            t.mul_(0.25)
    save_file(tensors, weights_file)
    return path
