"""Qwen3 dense decoder (`Qwen3ForCausalLM`): GQA attention with per-head q/k RMSNorm, SwiGLU MLP."""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..model_inputs import StepContext
from ..nn.activation import GatedMLP
from ..nn.attention import PagedAttention, qk_norm_of
from ..nn.linear import Embedding, Linear, MergedLinear, fusable
from ..nn.norm import RMSNorm
from ..nn.parallel import AllReduce
from ..nn.rotary import RotaryEmbedding
from .causal_lm import CausalLM


def head_dim_of(cfg) -> int:
    return getattr(cfg, 'head_dim', None) or cfg.hidden_size // cfg.num_attention_heads


class Qwen3Attention(nn.Module):

    def __init__(self, cfg, cache_index: int):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = head_dim_of(cfg)
        bias = getattr(cfg, 'attention_bias', False)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = MergedLinear(cfg.hidden_size, self.qkv_sizes, bias=bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, cache_index)

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, cos_sin, ctx: StepContext) -> torch.Tensor:
        return self._attend(self.qkv_proj(x), cos_sin, ctx)

    def forward_normed(self, x: torch.Tensor, norm: RMSNorm, rotary: RotaryEmbedding, cos_sin, ctx: StepContext
                       ) -> torch.Tensor:
        """forward(norm(x)), the norm and `qkv_proj` as one op (`RMSNorm.linear`) while that projection is a plain
        weight."""
        if fusable(self.qkv_proj):
            return self._attend(norm.linear(x, None, self.qkv_proj.weight)[0], cos_sin, ctx)
        return self(norm(x), rotary, cos_sin, ctx)

    def _attend(self, qkv: torch.Tensor, cos_sin, ctx: StepContext) -> torch.Tensor:
        q, k, v = qkv.split(self.qkv_sizes, dim=-1)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        # q/k norm and rotary inside the attention op (the cuda backend fuses them with the KV fill)
        out = self.attn(q, k, v, ctx, cos_sin=cos_sin, qk_norm=qk_norm_of(self.q_norm, self.k_norm))
        return self.o_proj(out.flatten(-2))


class Qwen3DecoderLayer(nn.Module):

    def __init__(self, cfg, cache_index: int):
        super().__init__()
        self.self_attn = Qwen3Attention(cfg, cache_index)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_reduce = AllReduce()  # tensor parallelism: sums the ranks' partial outputs (nn/parallel.py)
        self.mlp_reduce = AllReduce()

    def forward(self, x: torch.Tensor, rotary, cos_sin, ctx: StepContext) -> torch.Tensor:
        h = self.attn_reduce(self.self_attn.forward_normed(x, self.input_layernorm, rotary, cos_sin, ctx))
        h, x = self.mlp.forward_normed(h, x, self.post_attention_layernorm)
        return x + self.mlp_reduce(h)


class Qwen3Model(nn.Module):

    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg, head_dim_of(cfg))

    def forward(self, ctx: StepContext) -> torch.Tensor:
        x = self.embed_tokens(ctx.inputs.input_ids)
        cos_sin = self.rotary_emb.cos_sin(ctx.inputs.position_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, self.rotary_emb, cos_sin, ctx)
            if ctx.after_layer is not None:
                ctx.after_layer(i)
        return self.norm(x)


class Qwen3ForCausalLM(CausalLM):

    def __init__(self, hf_config):
        super().__init__()
        unsupported = set(getattr(hf_config, 'layer_types', None) or ['full_attention']) - {'full_attention'}
        if unsupported:
            raise NotImplementedError(f'Qwen3 layer types {sorted(unsupported)} are not supported')
        self.config = hf_config
        self.model = Qwen3Model(hf_config)
        self.init_lm_head(hf_config.hidden_size, hf_config.vocab_size,
                          bool(getattr(hf_config, 'tie_word_embeddings', False)))

    @staticmethod
    def build_model_config(hf_config, dtype: str, state_dtype: str = 'float32') -> ModelConfig:
        return ModelConfig(
            architecture='Qwen3ForCausalLM', hidden_size=hf_config.hidden_size,
            num_layers=hf_config.num_hidden_layers, vocab_size=hf_config.vocab_size,
            attn_layer_ids=tuple(range(hf_config.num_hidden_layers)), num_kv_heads=hf_config.num_key_value_heads,
            head_dim=head_dim_of(hf_config), dtype=dtype,
            max_position_embeddings=getattr(hf_config, 'max_position_embeddings', 32768))
