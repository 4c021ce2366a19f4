"""Rotary position embedding (neox layout, optional partial rotary), configured from a HF config.

Accepts both config layouts: `rope_parameters` (current transformers) and top-level `rope_theta` /
`partial_rotary_factor` / `rope_scaling` (older released checkpoints).
"""
from __future__ import annotations

import torch
from torch import nn

from ..backends.base import OpType
from ..backends.selector import current_backend


def read_rope_parameters(hf_config) -> dict:
    params = dict(getattr(hf_config, 'rope_parameters', None) or {})
    scaling = getattr(hf_config, 'rope_scaling', None)
    if isinstance(scaling, dict):
        params = {**scaling, **params}
    params.setdefault('rope_theta', getattr(hf_config, 'rope_theta', 10000.0))
    params.setdefault('partial_rotary_factor', getattr(hf_config, 'partial_rotary_factor', 1.0))
    params['rope_type'] = params.get('rope_type', params.get('type', 'default')) or 'default'
    return params


def _inv_freq(hf_config, head_dim: int, params: dict) -> tuple[torch.Tensor, float]:
    rotary_dim = int(head_dim * params['partial_rotary_factor'])
    if params['rope_type'] == 'default':
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        return 1.0 / (params['rope_theta'] ** exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    init = ROPE_INIT_FUNCTIONS.get(params['rope_type'])
    if init is None:
        raise ValueError(f"unsupported rope_type {params['rope_type']!r}")
    inv_freq, scaling = init(hf_config, 'cpu')
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):

    def __init__(self, hf_config, head_dim: int):
        super().__init__()
        params = read_rope_parameters(hf_config)
        inv_freq, self.attention_scaling = _inv_freq(hf_config, head_dim, params)
        self.register_buffer('inv_freq', inv_freq, persistent=False)
        self._impl = current_backend().build(OpType.ApplyRotary)

    def cos_sin(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, rotary_dim] for the given positions, in float32."""
        freqs = position_ids.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._impl(q, k, *cos_sin)
