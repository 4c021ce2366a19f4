"""Build one tensor-parallel rank's model: the class of the checkpoint built from `rank_hf_config` (its shapes are
exactly one rank's shards), filled with the rank's part of every parameter under the weight plan (`tp_plan.py`).

- `load_format='dummy'`: the rank's shards are drawn directly on the device, parameter by parameter: the full
  parameter is drawn with the same generator sequence `model_init.fill_dummy_` uses for the unsharded model (so a
  TP=N dummy model is the TP=1 dummy model, split), then sharded; only one full parameter is ever held at a time.
- a checkpoint: the full model is loaded on the host (the ordinary strict loader, every rename and fused-projection
  rule), then each parameter is sharded and copied to the rank's device. Host memory is therefore the full model
  per rank while loading (fine for the models one host serves in bf16 today; streaming each checkpoint tensor to its
  shard is the next step for the largest ones).
FP8 checkpoints load dequantized to the model dtype (the plan does not shard block scales yet).
"""
from __future__ import annotations

import torch
from torch import nn

from ..backends.selector import use_backend
from ..config import ModelConfig
from ..nn.linear import fuse_input_projections
from .loader import architecture_of, build_model, check_weights_fit, load_hf_config, read_eos_token_ids, torch_dtype
from .model_init import draw_dummy_, materialize_, param_bytes, params_on_meta
from .registry import get_model_class
from .tp_geometry import rank_hf_config, tp_geometry
from .tp_plan import shard_tensor, tp_shard_plan


def build_rank_model(model_path: str, device: torch.device, dtype: str, device_type: str, tp: int, rank: int,
                     state_dtype: str = 'float32', load_format: str = 'auto') -> tuple[nn.Module, ModelConfig]:
    """Rank `rank` of `tp`: its model with its weight shards, and its `ModelConfig` (per-rank KV heads and state
    shapes; every other field, vocabulary and special ids included, as the full model's)."""
    hf_config = load_hf_config(model_path)
    geometry = tp_geometry(hf_config, tp)
    model_cls = get_model_class(architecture_of(hf_config))
    rank_config = rank_hf_config(hf_config, tp)
    with use_backend(device_type):
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch_dtype(dtype))
        try:
            with params_on_meta():
                full_meta = model_cls(hf_config)
                model = model_cls(rank_config)
        finally:
            torch.set_default_dtype(default_dtype)
    plan = tp_shard_plan(full_meta, geometry)
    check_weights_fit(param_bytes(model), device)
    materialize_(model, device)
    params = dict(model.named_parameters())
    with torch.no_grad():
        if load_format == 'dummy':
            for name, full in draw_dummy_(full_meta, device):
                params[name].copy_(shard_tensor(full, plan[name], geometry, rank))
        else:
            host_model, _ = build_model(model_path, torch.device('cpu'), dtype, 'cpu', state_dtype,
                                        load_format=load_format, fp8_weights=False)
            for name, full in host_model.named_parameters():
                params[name].copy_(shard_tensor(full.detach(), plan[name], geometry, rank))
            del host_model
    fuse_input_projections(model)  # after the weights are in place: one GEMM per shared input
    model.eval()
    from dataclasses import replace
    config = model_cls.build_model_config(rank_config, dtype, dtype if state_dtype == 'model' else state_dtype)
    return model, replace(config, eos_token_ids=read_eos_token_ids(model_path, hf_config),
                          bos_token_id=getattr(hf_config, 'bos_token_id', None))
