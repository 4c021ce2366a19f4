"""Qwen3-Next (`Qwen3NextForCausalLM`) and the hybrid blocks it shares with Qwen3.5.

A decoder layer mixes tokens with either gated DeltaNet (`linear_attention`, recurrent state in the state pool)
or gated full attention (`full_attention`, KV in the KV pool), chosen by `config.layer_types`; then a dense SwiGLU
MLP or a sparse MoE. All norms are zero-centred RMSNorm (scale 1 + w) except the DeltaNet output norm, a gated
RMSNorm. Full attention has per-head q/k norm, partial rotary and a sigmoid output gate that `q_proj` emits next to
the query (per head: [query, gate]).

Internal weight layout (shared by every hybrid model here): the DeltaNet input projection is one matrix
`in_proj_qkvz` with rows [q (all key heads), k, v (all value heads), z] and `in_proj_ba` with rows [b, a].
Qwen3-Next checkpoints interleave those per key head; `Qwen3NextForCausalLM` reorders them at load time.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..config import ModelConfig, StateSpec
from ..model_inputs import StepContext
from ..nn.activation import GatedMLP
from ..nn.attention import PagedAttention, qk_norm_of
from ..nn.gated_delta import CausalConv1d, GatedDeltaGating, GatedDeltaRule
from ..nn.linear import Embedding, Linear, MergedLinear, fusable, fuse_rows, unstack
from ..nn.lora import lora_step
from ..nn.moe import SparseMoeBlock
from ..nn.norm import GatedRMSNorm, RMSNorm, norm_residual
from ..nn.parallel import AllReduce
from ..nn.rotary import RotaryEmbedding
from .causal_lm import CausalLM
from .mtp import MTPHead, mtp_num_layers_of

LINEAR_ATTENTION = 'linear_attention'
FULL_ATTENTION = 'full_attention'


def head_dim_of(cfg) -> int:
    return getattr(cfg, 'head_dim', None) or cfg.hidden_size // cfg.num_attention_heads


def layer_types_of(cfg) -> list[str]:
    """`config.layer_types`, or the classic pattern of one full-attention layer every `full_attention_interval`."""
    types = getattr(cfg, 'layer_types', None)
    if not types:
        interval = getattr(cfg, 'full_attention_interval', 4)
        types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
                 for i in range(cfg.num_hidden_layers)]
    types = list(types)[:cfg.num_hidden_layers]
    unknown = set(types) - {LINEAR_ATTENTION, FULL_ATTENTION}
    if unknown:
        raise NotImplementedError(f'layer types {sorted(unknown)} are not supported')
    return types


class GatedAttention(nn.Module):
    """GQA full attention with zero-centred q/k norm, partial rotary and a sigmoid output gate."""

    def __init__(self, cfg, cache_index: int):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = head_dim_of(cfg)
        bias = getattr(cfg, 'attention_bias', False)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # q_proj emits [query, gate] per head, hence twice the query width.
        self.qkv_proj = MergedLinear(cfg.hidden_size, [2 * q_size, kv_size, kv_size], bias=bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, zero_centered=True)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, zero_centered=True)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, cache_index)

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, cos_sin, ctx: StepContext) -> torch.Tensor:
        return self._attend(self.qkv_proj(x), cos_sin, ctx)

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, rotary: RotaryEmbedding,
                       cos_sin, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward(h), s) for h = norm(s), s = x + residual: the norm and `qkv_proj` as one op
        (`RMSNorm.linear`) while that projection is a plain weight."""
        if fusable(self.qkv_proj):
            qkv, residual, _ = norm.linear(x, residual, self.qkv_proj.weight)
            return self._attend(qkv, cos_sin, ctx), residual
        h, residual = norm_residual(norm, x, residual)
        return self(h, rotary, cos_sin, ctx), residual

    def _attend(self, qkv: torch.Tensor, cos_sin, ctx: StepContext) -> torch.Tensor:
        """The output from `qkv_proj`'s output."""
        q_gate, k, v = qkv.split(self.qkv_proj.shard_sizes, dim=-1)
        q, gate = q_gate.unflatten(-1, (self.num_heads, 2 * self.head_dim)).chunk(2, dim=-1)
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        # q/k norm and rotary (the cuda backend fuses them with the KV fill), and the sigmoid output gate (inside a
        # decode's merge launch there), inside the attention op
        out = self.attn(q, k, v, ctx, cos_sin=cos_sin, qk_norm=qk_norm_of(self.q_norm, self.k_norm),
                        output_gate=gate)
        return self.o_proj(out.flatten(-2))


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer; `state_index` is this layer's position in `ModelConfig.recurrent_layer_ids`."""

    def __init__(self, cfg, state_index: int):
        super().__init__()
        self.state_index = state_index
        self.num_k_heads = cfg.linear_num_key_heads
        self.num_v_heads = cfg.linear_num_value_heads
        self.head_k_dim = cfg.linear_key_head_dim
        self.head_v_dim = cfg.linear_value_head_dim
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f'linear_num_value_heads ({self.num_v_heads}) must be a multiple of '
                             f'linear_num_key_heads ({self.num_k_heads})')
        key_dim = self.num_k_heads * self.head_k_dim
        value_dim = self.num_v_heads * self.head_v_dim
        self.qkv_sizes = [key_dim, key_dim, value_dim]
        self.conv_dim = 2 * key_dim + value_dim
        activation = getattr(cfg, 'hidden_act', 'silu')
        if activation != 'silu':
            raise NotImplementedError(f'gated DeltaNet conv activation {activation!r} is not supported')
        self.in_proj_qkvz = MergedLinear(cfg.hidden_size, [self.conv_dim, value_dim])
        self.in_proj_ba = MergedLinear(cfg.hidden_size, [self.num_v_heads, self.num_v_heads])
        self.conv1d = CausalConv1d(self.conv_dim, cfg.linear_conv_kernel_dim, bias=False, activation='silu')
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.gating = GatedDeltaGating()
        self.gated_delta_rule = GatedDeltaRule(use_qk_l2norm=True)
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(value_dim, cfg.hidden_size)
        self._fused_in: torch.Tensor | None = None  # set after loading (fuse_input_projections)

    def fuse_input_projections(self) -> bool:
        """After loading: `in_proj_qkvz` and `in_proj_ba` as one GEMM (`nn.linear.fuse_rows`)."""
        self._fused_in = fuse_rows([self.in_proj_qkvz, self.in_proj_ba])
        return self._fused_in is not None

    def _in_proj(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(mixed_qkv, z, b, a) of x: one GEMM when fused and neither projection has gained a LoRA adapter."""
        qkvz, ba = self.in_proj_qkvz, self.in_proj_ba
        if self._fused_in is not None and qkvz.lora is None and ba.lora is None:
            return unstack(qkvz._impl(x, self._fused_in, None), qkvz.shard_sizes + ba.shard_sizes)
        return (*qkvz(x).split(qkvz.shard_sizes, dim=-1), *ba(x).split(ba.shard_sizes, dim=-1))

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return self._mix(self._in_proj(x), ctx)

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, ctx: StepContext
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward(h), s) for h = norm(s), s = x + residual: the norm and the fused input projection as one op
        (`RMSNorm.linear`) while `_in_proj` would run it as one GEMM."""
        qkvz, ba = self.in_proj_qkvz, self.in_proj_ba
        if self._fused_in is not None and qkvz.lora is None and ba.lora is None:
            projected, residual, _ = norm.linear(x, residual, self._fused_in)
            return self._mix(unstack(projected, qkvz.shard_sizes + ba.shard_sizes), ctx), residual
        h, residual = norm_residual(norm, x, residual)
        return self(h, ctx), residual

    def _mix(self, projected: tuple[torch.Tensor, ...], ctx: StepContext) -> torch.Tensor:
        """The output from the input projection's (mixed_qkv, z, b, a)."""
        states = ctx.state_caches[self.state_index]
        mixed_qkv, z, b, a = projected
        q, k, v = self.conv1d(mixed_qkv, states['conv'], ctx.inputs, out_splits=self.qkv_sizes)
        q = q.unflatten(-1, (self.num_k_heads, self.head_k_dim))
        k = k.unflatten(-1, (self.num_k_heads, self.head_k_dim))
        v = v.unflatten(-1, (self.num_v_heads, self.head_v_dim))
        # the gating and the gated output norm inside the rule's kernel where the backend can (decode)
        out = self.gated_delta_rule.forward_gating(q, k, v, a, b, self.A_log, self.dt_bias, self.gating,
                                                   states['recurrent'], ctx.inputs, norm=self.norm,
                                                   z=z.unflatten(-1, (self.num_v_heads, self.head_v_dim)))
        return self.out_proj(out.flatten(-2))


class HybridDecoderLayer(nn.Module):
    """`moe_index`: this layer's rank among the MoE layers (its column of the routed-experts record), or None when
    its MLP is dense (it records nothing)."""

    def __init__(self, cfg, layer_type: str, cache_index: int, mlp: nn.Module, moe_index: int | None = None):
        super().__init__()
        self.layer_type = layer_type
        self.moe_index = moe_index
        if layer_type == LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(cfg, cache_index)
        else:
            self.self_attn = GatedAttention(cfg, cache_index)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True)
        self.mixer_reduce = AllReduce()  # tensor parallelism: sums the ranks' partial outputs (nn/parallel.py)
        self.mlp_reduce = AllReduce()

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, cos_sin, ctx: StepContext) -> torch.Tensor:
        """The residual stream after this layer, from the one before it."""
        out, residual = self.forward_residual(x, None, rotary, cos_sin, ctx)
        return out + residual

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor | None, rotary: RotaryEmbedding, cos_sin,
                         ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual stream before the MLP): their sum is the stream after this layer. The stream
        before the layer is `x`, or `x + residual` when a residual is given (the previous layer's pair), an add
        that fuses into the input norm. The sums are those `forward` takes, in the same dtype: bit-identical. Each
        norm runs with the projection after it (`forward_normed` of the mixer and the MLP, `RMSNorm.linear`)."""
        if self.layer_type == LINEAR_ATTENTION:
            h, residual = self.linear_attn.forward_normed(x, residual, self.input_layernorm, ctx)
        else:
            h, residual = self.self_attn.forward_normed(x, residual, self.input_layernorm, rotary, cos_sin, ctx)
        h = self.mixer_reduce(h)
        if self.moe_index is None:
            h, residual = self.mlp.forward_normed(h, residual, self.post_attention_layernorm)
        else:
            h, residual = self.mlp.forward_normed(h, residual, self.post_attention_layernorm,
                                                  ctx.routes_of(self.moe_index))
        return self.mlp_reduce(h), residual


class HybridModel(nn.Module):
    """Embedding, decoder layers and final norm; `make_mlp(layer_id)` builds each layer's MLP, a `SparseMoeBlock`
    exactly for the layers in `moe_layer_ids`."""

    def __init__(self, cfg, make_mlp: Callable[[int], nn.Module], moe_layer_ids: tuple[int, ...] = ()):
        super().__init__()
        self.layer_types = layer_types_of(cfg)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        # Attention layers index the KV pool, DeltaNet layers the state pool, each by its rank among its kind; MoE
        # layers index the routed-experts record by their rank among MoE layers.
        self.layers = nn.ModuleList(
            HybridDecoderLayer(cfg, kind, self.layer_types[:i].count(kind), make_mlp(i),
                               moe_layer_ids.index(i) if i in moe_layer_ids else None)
            for i, kind in enumerate(self.layer_types))
        for layer_id, layer in enumerate(self.layers):
            if isinstance(layer.mlp, SparseMoeBlock) != (layer.moe_index is not None):
                raise ValueError(f'layer {layer_id}: MLP kind disagrees with moe_layer_ids {moe_layer_ids}')
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True)
        self.rotary_emb = RotaryEmbedding(cfg, head_dim_of(cfg))

    def forward(self, ctx: StepContext) -> torch.Tensor:
        return self.norm(self.hidden_states(ctx))

    def hidden_states(self, ctx: StepContext) -> torch.Tensor:
        """The last decoder layer's output [T, H], before the final norm (what the MTP head reads)."""
        inputs = ctx.inputs
        x = self.embed_tokens(inputs.input_ids)
        if inputs.mm_embeds is not None:  # image placeholders take the vision tower's embeddings
            x = x.index_copy(0, inputs.mm_token_rows, inputs.mm_embeds.to(x.dtype))
        positions = inputs.position_ids if inputs.mrope_position_ids is None else inputs.mrope_position_ids
        cos_sin = self.rotary_emb.cos_sin(positions)
        residual = None
        for i, layer in enumerate(self.layers):  # each layer's residual add runs inside the next layer's input norm
            x, residual = layer.forward_residual(x, residual, self.rotary_emb, cos_sin, ctx)
            if ctx.after_layer is not None:
                ctx.after_layer(i)
        return x if residual is None else x + residual


class HybridForCausalLM(CausalLM):
    """Shared causal-LM wrapper of the hybrid models; subclasses choose the MLPs and map checkpoint names."""

    def __init__(self, hf_config):
        super().__init__()
        self.config = cfg = self.text_config_of(hf_config)
        self.model = HybridModel(cfg, self.make_mlp, self.moe_layer_ids(cfg))
        tie = getattr(hf_config, 'tie_word_embeddings', None)  # the top-level config decides for VL checkpoints
        self.init_lm_head(cfg.hidden_size, cfg.vocab_size,
                          bool(getattr(cfg, 'tie_word_embeddings', False) if tie is None else tie))
        self.mtp: MTPHead | None = None  # built by `enable_mtp` (speculative decoding with method 'mtp')

    def enable_mtp(self) -> int:
        """Build the MTP head (`mtp.*` weights then load into it); returns its number of layers. Its layer i is a
        full-attention decoder layer with layer 0's kind of MLP, on KV pool layer `num_attn_layers + i`."""
        cfg = self.config
        num_layers = mtp_num_layers_of(cfg)
        if num_layers <= 0:
            raise ValueError(f'{type(self).__name__}: the config declares no MTP head (mtp_num_hidden_layers / '
                             'num_nextn_predict_layers is 0 or missing), so speculative method \'mtp\' cannot run')
        num_attn = self.model.layer_types.count(FULL_ATTENTION)
        def make_layer(i: int, cache_index: int) -> HybridDecoderLayer:
            return HybridDecoderLayer(cfg, FULL_ATTENTION, cache_index, self.make_mlp(0))

        self.mtp = MTPHead(cfg, num_layers, num_attn, make_layer)
        return num_layers

    def forward_with_hidden(self, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed hidden states for the logits, pre-norm hidden states for the MTP head), both [T, H]."""
        hidden = self.pre_norm_hidden(ctx)
        return self.final_norm(hidden), hidden

    def pre_norm_hidden(self, ctx: StepContext) -> torch.Tensor:
        """The last decoder layer's output [T, H] (what the MTP head reads; `final_norm` of it is `forward`)."""
        with lora_step(ctx.inputs):
            return self.model.hidden_states(ctx)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.norm(hidden)

    def draft_hidden(self, prev_hidden: torch.Tensor, ctx: StepContext, step: int = 0) -> torch.Tensor:
        """The MTP head's normed hidden states (see `MTPHead.forward`); logits via `compute_logits`."""
        if self.mtp is None:
            raise RuntimeError('the MTP head is not built (enable_mtp)')
        return self.mtp(self.model.embed_tokens, self.model.rotary_emb, prev_hidden, ctx, step)

    @staticmethod
    def text_config_of(hf_config):
        return getattr(hf_config, 'text_config', None) or hf_config

    def make_mlp(self, layer_id: int) -> nn.Module:
        return GatedMLP(self.config.hidden_size, self.config.intermediate_size)

    @classmethod
    def moe_layer_ids(cls, cfg) -> tuple[int, ...]:
        """Layers whose MLP is a sparse MoE (none here); `make_mlp` builds a `SparseMoeBlock` exactly for them."""
        return ()

    @classmethod
    def build_model_config(cls, hf_config, dtype: str, state_dtype: str = 'float32') -> ModelConfig:
        cfg = cls.text_config_of(hf_config)
        types = layer_types_of(cfg)
        linear = tuple(i for i, kind in enumerate(types) if kind == LINEAR_ATTENTION)
        conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim \
            + cfg.linear_num_value_heads * cfg.linear_value_head_dim
        specs = (StateSpec('conv', (conv_dim, cfg.linear_conv_kernel_dim - 1), dtype),
                 StateSpec('recurrent', (cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                         cfg.linear_value_head_dim), state_dtype)) if linear else ()
        full = tuple(i for i, kind in enumerate(types) if kind == FULL_ATTENTION)
        moe = cls.moe_layer_ids(cfg)
        return ModelConfig(
            architecture=cls.__name__, hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers,
            vocab_size=cfg.vocab_size, attn_layer_ids=full,
            num_kv_heads=cfg.num_key_value_heads, head_dim=head_dim_of(cfg), dtype=dtype,
            max_position_embeddings=getattr(cfg, 'max_position_embeddings', 32768),
            recurrent_layer_ids=linear, state_specs=specs, moe_layer_ids=moe,
            moe_top_k=cfg.num_experts_per_tok if moe else 0)


# ---- Qwen3-Next ---------------------------------------------------------------------------------------------------
def interleaved_qkvz_to_blocked(weight: torch.Tensor, num_k_heads: int, head_k_dim: int, num_v_heads: int,
                                head_v_dim: int) -> torch.Tensor:
    """Qwen3-Next `in_proj_qkvz` rows, grouped per key head as [q, k, v (r heads), z (r heads)] with
    r = num_v_heads / num_k_heads, -> rows [q all, k all, v all, z all] (value head order kept)."""
    r = num_v_heads // num_k_heads
    grouped = weight.reshape(num_k_heads, 2 * head_k_dim + 2 * r * head_v_dim, -1)
    parts = grouped.split([head_k_dim, head_k_dim, r * head_v_dim, r * head_v_dim], dim=1)
    return torch.cat([p.reshape(-1, weight.size(-1)) for p in parts])


def interleaved_ba_to_blocked(weight: torch.Tensor, num_k_heads: int, num_v_heads: int) -> torch.Tensor:
    """Qwen3-Next `in_proj_ba` rows, grouped per key head as [b (r heads), a (r heads)] -> rows [b all, a all]."""
    r = num_v_heads // num_k_heads
    b, a = weight.reshape(num_k_heads, 2 * r, -1).split([r, r], dim=1)
    return torch.cat([b.reshape(-1, weight.size(-1)), a.reshape(-1, weight.size(-1))])


class Qwen3NextForCausalLM(HybridForCausalLM):
    """Qwen3-Next: sparse MoE (softmax top-k + gated shared expert) except in `mlp_only_layers`, and layers
    skipped by `decoder_sparse_step`, which use a dense MLP."""

    @classmethod
    def moe_layer_ids(cls, cfg) -> tuple[int, ...]:
        dense_layers = getattr(cfg, 'mlp_only_layers', None) or []
        if getattr(cfg, 'num_experts', 0) <= 0:
            return ()
        step = getattr(cfg, 'decoder_sparse_step', 1)
        return tuple(i for i in range(cfg.num_hidden_layers) if i not in dense_layers and (i + 1) % step == 0)

    def make_mlp(self, layer_id: int) -> nn.Module:
        cfg = self.config
        if layer_id not in self.moe_layer_ids(cfg):
            return GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        return SparseMoeBlock(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                              norm_topk_prob=getattr(cfg, 'norm_topk_prob', True),
                              shared_expert=GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size))

    def convert_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        if name.endswith('linear_attn.in_proj_qkvz.weight_scale_inv'):
            # FP8 kept: reorder the scale grid like the rows, which needs each head's rows to be whole blocks
            block_rows = self.get_submodule(name.rpartition('.')[0]).weight_block_size[0]
            if cfg.linear_key_head_dim % block_rows or cfg.linear_value_head_dim % block_rows:
                raise ValueError(f'{name}: FP8 blocks of {block_rows} rows straddle the per-head groups of '
                                 f'in_proj_qkvz (head dims {cfg.linear_key_head_dim} / {cfg.linear_value_head_dim})')
            return interleaved_qkvz_to_blocked(tensor, cfg.linear_num_key_heads, cfg.linear_key_head_dim // block_rows,
                                               cfg.linear_num_value_heads, cfg.linear_value_head_dim // block_rows)
        if name.endswith('linear_attn.in_proj_ba.weight_scale_inv'):
            raise ValueError(f'{name}: FP8 in_proj_ba is not supported (its per-head groups are narrower than a block)')
        if name.endswith('linear_attn.in_proj_qkvz.weight'):
            return interleaved_qkvz_to_blocked(tensor, cfg.linear_num_key_heads, cfg.linear_key_head_dim,
                                               cfg.linear_num_value_heads, cfg.linear_value_head_dim)
        if name.endswith('linear_attn.in_proj_ba.weight'):
            return interleaved_ba_to_blocked(tensor, cfg.linear_num_key_heads, cfg.linear_num_value_heads)
        return tensor
