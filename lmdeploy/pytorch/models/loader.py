"""Build a model from a Hugging Face checkpoint folder: config via transformers, weights via safetensors.

Order: config -> FP8 settings and header validation -> construction with parameters on meta -> FP8 layer plan ->
weight memory estimate (refused before allocating if it cannot fit) -> allocation on the device -> weights from the
checkpoint (parallel reader, progress bar) or dummy values.
"""
from __future__ import annotations

import json
import logging
import os

import torch
from torch import nn

from ..backends.selector import use_backend
from ..config import ModelConfig
from ..nn.blocked_fp8 import FP8_DTYPE
from ..nn.linear import fuse_input_projections
from .checkpoint import Checkpoint
from .fp8_plan import plan_blocked_fp8, read_fp8_config, validate_fp8_tensors
from .model_init import fill_dummy_, materialize_, param_bytes, params_on_meta
from .registry import get_model_class

logger = logging.getLogger('lmdeploy')

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


def fp8_compute_supported(device: torch.device) -> bool:
    """FP8 tensor-core GEMMs: CUDA devices of compute capability 8.9 (Ada) / 9.0 (Hopper) and later."""
    return device.type == 'cuda' and torch.cuda.get_device_capability(device) >= (8, 9)


def check_weights_fit(num_bytes: int, device: torch.device) -> None:
    """Refuse, before allocating, weights larger than the device's free memory."""
    if device.type != 'cuda':
        return
    free, total = torch.cuda.mem_get_info(device)
    if num_bytes > free:
        raise ValueError(f'the model weights need {num_bytes / 2**30:.1f} GiB but {device} has {free / 2**30:.1f} '
                         f'GiB free (of {total / 2**30:.1f} GiB); use an FP8 checkpoint, a smaller model or more GPUs')


def build_model(model_path: str, device: torch.device, dtype: str, device_type: str, state_dtype: str = 'float32',
                load_format: str = 'auto', fp8_weights: bool | None = None, mtp: bool = False
                ) -> tuple[nn.Module, ModelConfig]:
    """Model with weights loaded, and its `ModelConfig`; `state_dtype` is 'float32' or 'model'.

    `load_format` 'auto' / 'safetensors' read the folder's weights, 'dummy' draws random ones on the device (only
    config.json is needed). `fp8_weights`: keep FP8 checkpoint weights as FP8 (default: where FP8 GEMMs run, i.e.
    CUDA with compute capability >= 8.9); otherwise they are dequantized to `dtype` at load. `mtp`: also build and
    load the multi-token-prediction head (`mtp.*`, speculative method 'mtp'); `ModelConfig.num_mtp_layers` says how
    many KV-pool layers it adds.
    """
    hf_config = load_hf_config(model_path)
    model_cls = get_model_class(architecture_of(hf_config))
    fp8_config = read_fp8_config(hf_config)
    checkpoint = None if load_format == 'dummy' else Checkpoint(model_path)
    infos = checkpoint.tensor_infos() if checkpoint is not None else None
    if infos is not None:
        validate_fp8_tensors(infos, fp8_config)
    keep_fp8 = fp8_compute_supported(device) if fp8_weights is None else fp8_weights
    with use_backend(device_type):
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch_dtype(dtype))
        try:
            with params_on_meta():
                model = model_cls(hf_config)
                num_mtp_layers = _enable_mtp(model, infos, model_path) if mtp else 0
            fp8_kept = plan_blocked_fp8(model, infos, fp8_config, keep_fp8)
        finally:
            torch.set_default_dtype(default_dtype)
    num_bytes = param_bytes(model)
    logger.info('model weights: %.2f GiB on %s (%s)', num_bytes / 2**30, device,
                'FP8 layers kept' if any(p.dtype == FP8_DTYPE for p in model.parameters()) else dtype)
    check_weights_fit(num_bytes, device)
    materialize_(model, device)
    if checkpoint is None:
        fill_dummy_(model)
    else:
        tensors = checkpoint.iter_tensors()
        try:
            model.load_weights(tensors, fp8_kept=fp8_kept,
                               fp8_block_size=fp8_config.block_size if fp8_config else None)
        finally:
            tensors.close()  # a failed load stops the reader threads now, not when the traceback is freed
    fuse_input_projections(model)  # after the weights are in place: one GEMM per shared input
    model.eval()
    config = model_cls.build_model_config(hf_config, dtype, dtype if state_dtype == 'model' else state_dtype)
    if num_mtp_layers:
        from dataclasses import replace
        config = replace(config, num_mtp_layers=num_mtp_layers)
    eos = read_eos_token_ids(model_path, hf_config)
    bos = getattr(hf_config, 'bos_token_id', None)
    return model, _with_special_ids(config, eos, bos)


def _enable_mtp(model: nn.Module, infos: dict | None, model_path: str) -> int:
    """Build `model`'s MTP head; refuses models without one and checkpoints without `mtp.*` weights."""
    enable = getattr(model, 'enable_mtp', None)
    if enable is None:
        raise ValueError(f'speculative method \'mtp\' needs a model with an MTP head (Qwen3.5, Qwen3-Next); '
                         f'{type(model).__name__} has none')
    num_layers = enable()
    if infos is not None and not any(name.startswith('mtp.') for name in infos):
        raise ValueError(f'speculative method \'mtp\': the checkpoint in {model_path!r} has no mtp.* weights '
                         '(its config declares an MTP head, but the weights were stripped)')
    return num_layers


def _with_special_ids(config: ModelConfig, eos: tuple[int, ...], bos: int | None) -> ModelConfig:
    from dataclasses import replace
    return replace(config, eos_token_ids=eos, bos_token_id=bos)
