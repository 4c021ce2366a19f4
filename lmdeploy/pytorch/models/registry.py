"""The explicit table from Hugging Face architecture names to our model classes."""
from __future__ import annotations

import importlib

# HF `architectures[0]` -> (module under lmdeploy.pytorch.models, class name)
MODULE_MAP: dict[str, tuple[str, str]] = {
    'Qwen3ForCausalLM': ('qwen3', 'Qwen3ForCausalLM'),
}


def get_model_class(architecture: str) -> type:
    entry = MODULE_MAP.get(architecture)
    if entry is None:
        raise ValueError(f'unsupported architecture {architecture!r}; supported: {sorted(MODULE_MAP)}')
    module = importlib.import_module(f'{__package__}.{entry[0]}')
    return getattr(module, entry[1])
