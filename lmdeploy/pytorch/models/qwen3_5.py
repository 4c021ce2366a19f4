"""Qwen3.5 models: text-only dense (`Qwen3_5ForCausalLM`) and MoE (`Qwen3_5MoeForCausalLM`), and the released
vision-language checkpoints (`Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForConditionalGeneration`).

The layers are Qwen3-Next's hybrid blocks (see `qwen3_next.py`); Qwen3.5 differs in the checkpoint layout only:
the DeltaNet projections are separate (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`) and load as shards
of our fused `in_proj_qkvz` / `in_proj_ba`. The vision-language checkpoints keep the text config under
`text_config` and the weights under `model.language_model.*`; their vision tower (`vision_config`,
`model.visual.*`) loads into `Qwen3_5VisionModel`, whose merged embeddings replace the image placeholder
embeddings. Image tokens take interleaved M-RoPE positions (`rope_parameters['mrope_section']`); text tokens use
equal positions on all three axes, which is plain rotary. Multi-token-prediction weights (`mtp.*`) load into the
MTP head (`mtp.py`) when speculative decoding builds it, and are skipped otherwise.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..nn.moe import SparseMoeBlock
from .qwen3_5_vision import GridTHW, Qwen3_5VisionModel
from .qwen3_next import GatedMLP, HybridForCausalLM

_LANGUAGE_MODEL_PREFIX = 'model.language_model.'
_VISUAL_PREFIXES = ('model.visual.', 'visual.')


class Qwen3_5ForCausalLM(HybridForCausalLM):

    stacked_params = HybridForCausalLM.stacked_params + [
        ('in_proj_qkvz', 'in_proj_qkv', 0), ('in_proj_qkvz', 'in_proj_z', 1),
        ('in_proj_ba', 'in_proj_b', 0), ('in_proj_ba', 'in_proj_a', 1)]

    def rename_weight(self, name: str) -> str | None:
        if name.startswith(_VISUAL_PREFIXES):
            return None  # a text-only class over a VL checkpoint
        if name.startswith(_LANGUAGE_MODEL_PREFIX):
            name = 'model.' + name[len(_LANGUAGE_MODEL_PREFIX):]
        return super().rename_weight(name)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Every layer's MLP is a sparse MoE with renormalised top-k weights and a gated shared expert."""

    @classmethod
    def moe_layer_ids(cls, cfg) -> tuple[int, ...]:
        return tuple(range(cfg.num_hidden_layers))

    def make_mlp(self, layer_id: int) -> nn.Module:
        cfg = self.config
        return SparseMoeBlock(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                              norm_topk_prob=True,
                              shared_expert=GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size))


class _VisionLanguageMixin:
    """Adds the vision tower to a Qwen3.5 text class; `visual` is None when the config has no `vision_config`."""

    def _init_visual(self, hf_config) -> None:
        vision_cfg = getattr(hf_config, 'vision_config', None)
        self.visual = Qwen3_5VisionModel(vision_cfg) if vision_cfg is not None else None
        self.image_token_id = getattr(hf_config, 'image_token_id', None) if vision_cfg is not None else None

    @classmethod
    def build_model_config(cls, hf_config, dtype: str, state_dtype: str = 'float32') -> ModelConfig:
        from dataclasses import replace
        config = super().build_model_config(hf_config, dtype, state_dtype)
        has_tower = getattr(hf_config, 'vision_config', None) is not None
        return replace(config, image_token_id=getattr(hf_config, 'image_token_id', None) if has_tower else None)

    def encode_images(self, pixel_values: torch.Tensor, grids: list[GridTHW]) -> torch.Tensor:
        """Merged image embeddings [sum(t * h * w) / merge**2, hidden] of the packed images (in order)."""
        if self.visual is None:
            raise ValueError('this checkpoint has no vision tower')
        return self.visual(pixel_values, grids)

    def num_image_tokens(self, grid_thw: GridTHW) -> int:
        return self.visual.num_merged_tokens(grid_thw)

    def rename_weight(self, name: str) -> str | None:
        for prefix in _VISUAL_PREFIXES:
            if name.startswith(prefix):
                return 'visual.' + name[len(prefix):] if self.visual is not None else None
        return super().rename_weight(name)

    def convert_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name == 'visual.patch_embed.proj.weight':
            return tensor.reshape(tensor.size(0), -1)  # Conv3d [out, C, tp, p, p] -> its matmul [out, C*tp*p*p]
        return super().convert_weight(name, tensor)


class Qwen3_5ForConditionalGeneration(_VisionLanguageMixin, Qwen3_5ForCausalLM):

    def __init__(self, hf_config):
        super().__init__(hf_config)
        self._init_visual(hf_config)


class Qwen3_5MoeForConditionalGeneration(_VisionLanguageMixin, Qwen3_5MoeForCausalLM):

    def __init__(self, hf_config):
        super().__init__(hf_config)
        self._init_visual(hf_config)
