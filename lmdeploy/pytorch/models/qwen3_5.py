"""Qwen3.5 text models: dense (`Qwen3_5ForCausalLM`) and MoE (`Qwen3_5MoeForCausalLM`).

The layers are Qwen3-Next's hybrid blocks (see `qwen3_next.py`); Qwen3.5 differs in the checkpoint layout only:
the DeltaNet projections are separate (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`) and load as shards
of our fused `in_proj_qkvz` / `in_proj_ba`. The released checkpoints are vision-language models
(`*ForConditionalGeneration`: config under `text_config`, weights under `model.language_model.*`); their text part
loads into the same classes (vision / multi-token-prediction weights: `weight_loading.IGNORED_CHECKPOINT_PREFIXES`).
For text-only positions the interleaved multimodal rotary embedding equals plain rotary, so
`rope_parameters['mrope_*']` is not needed here.
"""
from __future__ import annotations

from torch import nn

from ..nn.moe import SparseMoeBlock
from .qwen3_next import GatedMLP, HybridForCausalLM

_LANGUAGE_MODEL_PREFIX = 'model.language_model.'


class Qwen3_5ForCausalLM(HybridForCausalLM):

    stacked_params = HybridForCausalLM.stacked_params + [
        ('in_proj_qkvz', 'in_proj_qkv', 0), ('in_proj_qkvz', 'in_proj_z', 1),
        ('in_proj_ba', 'in_proj_b', 0), ('in_proj_ba', 'in_proj_a', 1)]

    def rename_weight(self, name: str) -> str | None:
        if name.startswith(_LANGUAGE_MODEL_PREFIX):
            name = 'model.' + name[len(_LANGUAGE_MODEL_PREFIX):]
        return super().rename_weight(name)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Every layer's MLP is a sparse MoE with renormalised top-k weights and a gated shared expert."""

    def make_mlp(self, layer_id: int) -> nn.Module:
        cfg = self.config
        return SparseMoeBlock(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                              norm_topk_prob=True,
                              shared_expert=GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size))
