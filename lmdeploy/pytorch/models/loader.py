"""Build a model from a Hugging Face checkpoint folder: config via transformers, weights via safetensors."""
from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
from torch import nn

from ..backends.selector import use_backend
from ..config import ModelConfig
from .registry import get_model_class

_TORCH_DTYPES = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


def load_hf_config(model_path: str):
    if not os.path.isfile(os.path.join(model_path, 'config.json')):
        raise ValueError(f'{model_path!r} is not a Hugging Face model folder (no config.json)')
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(model_path, trust_remote_code=False)


def architecture_of(hf_config) -> str:
    archs = getattr(hf_config, 'architectures', None) or []
    if not archs:
        raise ValueError('config.json names no architecture')
    return archs[0]


def read_eos_token_ids(model_path: str, hf_config) -> tuple[int, ...]:
    """eos ids from generation_config.json, falling back to config.json."""
    ids = None
    path = os.path.join(model_path, 'generation_config.json')
    if os.path.isfile(path):
        with open(path) as f:
            ids = json.load(f).get('eos_token_id')
    if ids is None:
        ids = getattr(hf_config, 'eos_token_id', None)
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, list | tuple) else (int(ids),)


def iter_safetensors(model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """All tensors of a checkpoint folder (single file or a sharded index)."""
    index = os.path.join(model_path, 'model.safetensors.index.json')
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)['weight_map'].values()))
    else:
        files = sorted(f for f in os.listdir(model_path) if f.endswith('.safetensors'))
    if not files:
        raise ValueError(f'no *.safetensors weights in {model_path!r}')
    for file in files:
        with safe_open(os.path.join(model_path, file), framework='pt') as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def build_model(model_path: str, device: torch.device, dtype: str, device_type: str, state_dtype: str = 'float32'
                ) -> tuple[nn.Module, ModelConfig]:
    """Model with weights loaded, and its `ModelConfig`; `state_dtype` is 'float32' or 'model'."""
    hf_config = load_hf_config(model_path)
    model_cls = get_model_class(architecture_of(hf_config))
    with use_backend(device_type), torch.device(device):
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch_dtype(dtype))
        try:
            model = model_cls(hf_config)
        finally:
            torch.set_default_dtype(default_dtype)
    model.load_weights(iter_safetensors(model_path))
    model.eval()
    config = model_cls.build_model_config(hf_config, dtype, dtype if state_dtype == 'model' else state_dtype)
    eos = read_eos_token_ids(model_path, hf_config)
    bos = getattr(hf_config, 'bos_token_id', None)
    return model, _with_special_ids(config, eos, bos)


def _with_special_ids(config: ModelConfig, eos: tuple[int, ...], bos: int | None) -> ModelConfig:
    from dataclasses import replace
    return replace(config, eos_token_ids=eos, bos_token_id=bos)
