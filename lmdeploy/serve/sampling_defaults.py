"""The model's own sampling defaults, from its `generation_config.json` (as released Qwen checkpoints ship them).

They replace the API defaults for the fields a request leaves unset (server) or when no `GenerationConfig` is given
(pipeline); `generation_config='none'` turns them off (vLLM's `--generation-config`). Only sampling fields are
taken; token ids (eos, pad) are the engine's business.
"""
from __future__ import annotations

import json
import logging
import os

logger = logging.getLogger('lmdeploy')

# generation_config.json key -> request / GenerationConfig field
SAMPLING_KEYS = ('temperature', 'top_p', 'top_k', 'min_p', 'repetition_penalty')


def load_sampling_defaults(model_path: str, mode: str = 'auto') -> dict[str, float | int]:
    """`mode`: 'auto' (the model folder's file), 'none' (no defaults), or a folder holding a generation_config.json."""
    if mode == 'none':
        return {}
    folder = model_path if mode == 'auto' else mode
    path = os.path.join(folder, 'generation_config.json')
    if not os.path.isfile(path):
        if mode != 'auto':
            raise ValueError(f'--generation-config {mode!r}: no generation_config.json there')
        return {}
    with open(path, encoding='utf-8') as f:
        config = json.load(f)
    defaults = {key: config[key] for key in SAMPLING_KEYS
                if isinstance(config.get(key), int | float) and not isinstance(config.get(key), bool)}
    if config.get('do_sample') is False:
        defaults['temperature'] = 0.0  # transformers' greedy: temperature is ignored without do_sample
    if defaults:
        logger.info('sampling defaults from %s: %s', path, defaults)
    return defaults


def apply_to_generation_config(gen, defaults: dict) -> None:
    """Set `gen`'s sampling fields from `defaults` (a config built without the user's values)."""
    for key, value in defaults.items():
        setattr(gen, key, value)
    if 'temperature' in defaults:
        gen.do_sample = defaults['temperature'] > 0
        gen.temperature = defaults['temperature'] or 1.0
