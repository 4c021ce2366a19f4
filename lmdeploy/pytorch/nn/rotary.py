"""Rotary position embedding (neox layout, optional partial rotary, optional M-RoPE), configured from a HF config.

Accepts both config layouts: `rope_parameters` (current transformers) and top-level `rope_theta` /
`partial_rotary_factor` / `rope_scaling` (older released checkpoints).

M-RoPE (`mrope_section`, Qwen-VL): positions are 3-D (temporal, height, width) and each rotary frequency takes one
axis. With `mrope_interleaved` the axes alternate T, H, W, T, H, W, ... (frequency i takes H when i % 3 == 1 and
i < 3 * section[1], W when i % 3 == 2 and i < 3 * section[2], T otherwise); without it the sections are contiguous.
When all three axes are equal (text) this is plain rotary, so 1-D positions stay valid for text-only tokens.
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


def mrope_axis_of_frequency(section: list[int], interleaved: bool) -> torch.Tensor:
    """[sum(section)] int64: the position axis (0 = T, 1 = H, 2 = W) each rotary frequency rotates by."""
    num = sum(section)
    if not interleaved:
        return torch.repeat_interleave(torch.arange(3), torch.tensor(section))
    axis = torch.zeros(num, dtype=torch.int64)
    for dim in (1, 2):
        axis[dim:3 * section[dim]:3] = dim
    return axis


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
        section = params.get('mrope_section')
        if section is not None and sum(section) != inv_freq.numel():
            raise ValueError(f'mrope_section {section} must sum to rotary_dim / 2 = {inv_freq.numel()}')
        axis = mrope_axis_of_frequency(list(section), bool(params.get('mrope_interleaved', False))) \
            if section is not None else None
        self.register_buffer('mrope_axis', axis, persistent=False)
        self._impl = current_backend().build(OpType.ApplyRotary)

    def cos_sin(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, rotary_dim] for positions [T] or M-RoPE positions [3, T], in float32."""
        inv_freq = self.inv_freq.float()
        if position_ids.ndim == 2:
            if self.mrope_axis is None:
                raise ValueError('3-D positions need a model with mrope_section')
            per_axis = position_ids.float()[:, :, None] * inv_freq  # [3, T, F]
            index = self.mrope_axis.view(1, 1, -1).expand(1, per_axis.size(1), -1)
            freqs = per_axis.gather(0, index).squeeze(0)
        else:
            freqs = position_ids.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._impl(q, k, *cos_sin)
