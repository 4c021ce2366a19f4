"""The explicit table from Hugging Face architecture names to our model classes."""
from __future__ import annotations

import importlib

# HF `architectures[0]` -> (module under lmdeploy.pytorch.models, class name)
MODULE_MAP: dict[str, tuple[str, str]] = {
    'Qwen3ForCausalLM': ('qwen3', 'Qwen3ForCausalLM'),
    'Qwen3NextForCausalLM': ('qwen3_next', 'Qwen3NextForCausalLM'),
    'Qwen3_5ForCausalLM': ('qwen3_5', 'Qwen3_5ForCausalLM'),
    'Qwen3_5ForConditionalGeneration': ('qwen3_5', 'Qwen3_5ForConditionalGeneration'),
    'Qwen3_5MoeForCausalLM': ('qwen3_5', 'Qwen3_5MoeForCausalLM'),
    'Qwen3_5MoeForConditionalGeneration': ('qwen3_5', 'Qwen3_5MoeForConditionalGeneration'),
}


def get_model_class(architecture: str) -> type:
    entry = MODULE_MAP.get(architecture)
    if entry is None:
        raise ValueError(f'unsupported architecture {architecture!r}; supported: {sorted(MODULE_MAP)}')
    module = importlib.import_module(f'{__package__}.{entry[0]}')
    return getattr(module, entry[1])
