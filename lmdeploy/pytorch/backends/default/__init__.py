"""The `default` backend: plain torch, runs on CPU and GPU. Every other backend falls back to it."""
from __future__ import annotations

import itertools

import torch

from ...kernels.default import blocked_fp8 as _fp8
from ...kernels.default import cache_copy as _cache_copy
from ...kernels.default import causal_conv1d as _conv
from ...kernels.default import gated_delta_rule as _gdr
from ...kernels.default import lora as _lora
from ...kernels.default import paged_attention as _attn
from ...kernels.default import varlen_attention as _varlen
from ..base import Backend, OpType
from . import elementwise, moe, sampling


def _const(fn):
    """A builder that ignores construction arguments and returns `fn` itself."""
    def build(**_kwargs):
        return fn
    return build


def _build_attention(**_kwargs):
    def forward(q, k, v, k_cache, v_cache, inputs, scale, cos_sin=None, qk_norm=None, output_gate=None):
        if qk_norm is not None:
            q = elementwise.rms_norm(q, qk_norm.q_weight, qk_norm.eps, qk_norm.zero_centered)
            k = elementwise.rms_norm(k, qk_norm.k_weight, qk_norm.eps, qk_norm.zero_centered)
        if cos_sin is not None:
            q, k = elementwise.apply_rotary(q, k, *cos_sin)
        _attn.fill_kv_cache(k, v, k_cache, v_cache, inputs.slot_mapping)
        out = _attn.paged_attention(q, k_cache, v_cache, inputs.block_tables, inputs.q_lens_list,
                                    inputs.kv_lens_list, scale)
        return out if output_gate is None else elementwise.sigmoid_gate_mul(out, output_gate)
    return forward


def _build_vision_attention(**_kwargs):
    def forward(q, k, v, cu_seqlens, cu_seqlens_list, max_seqlen, scale):
        return _varlen.varlen_attention(q, k, v, cu_seqlens_list, scale)
    return forward


def gated_delta_rule_builder(chunk_fn, recurrent_fn, chunk_kwargs=None):
    """A builder over a (chunked, recurrent) kernel pair with the default kernels' signatures; `chunk_kwargs(inputs,
    device) -> dict` adds backend-specific keyword arguments to the chunked call."""
    def build(**_kwargs):
        def forward(q, k, v, g, beta, state, inputs, use_qk_l2norm=True):
            # Pure decode batches (and graph-captured prefills) take the token-by-token form; anything else with a
            # prefill takes the chunked form.
            if inputs.is_decode or inputs.use_recurrent_kernel:
                return recurrent_fn(q, k, v, g, beta, inputs.cu_seqlens_q, state, inputs.state_ids, inputs.is_fresh,
                                    use_qk_l2norm=use_qk_l2norm, max_seqlen=inputs.max_seqlen_q)
            extra = chunk_kwargs(inputs, q.device) if chunk_kwargs is not None else {}
            return chunk_fn(q, k, v, g, beta, inputs.cu_seqlens_q, state, inputs.state_ids, inputs.is_fresh,
                            use_qk_l2norm=use_qk_l2norm, **extra)
        return forward
    return build


def causal_conv1d_builder(conv_fn):
    """A builder over a causal conv1d kernel with the default kernel's signature; `out_splits` hands back the
    channel groups of the output (here views of one [T, C] tensor)."""
    def build(**_kwargs):
        def forward(x, weight, bias, conv_state, inputs, activation='silu', out_splits=None):
            out = conv_fn(x, weight, bias, conv_state, inputs.state_ids, inputs.is_fresh, inputs.cu_seqlens_q,
                          activation=activation)
            return out if out_splits is None else out.split(list(out_splits), dim=-1)
        return forward
    return build


def blocked_fp8_builder(fn):
    """A builder over an FP8 op whose last argument is the weights' `block_size` (given at construction)."""
    def build(block_size: tuple[int, int], **_kwargs):
        def forward(*args):
            return fn(*args, block_size=block_size)
        return forward
    return build


def token_lora_slots(inputs):
    """Each token's adapter slot [T] (from the per-sequence `inputs.lora_ids`), built once per forward."""
    return inputs.derived('lora_token_slots', lambda: torch.repeat_interleave(
        inputs.lora_ids, inputs.q_lens, output_size=inputs.input_ids.numel()))


def _build_lora(**_kwargs):
    def forward(x, out, lora_a, lora_b, slice_sizes, inputs):
        return _lora.lora_shrink_expand(x, out, lora_a, lora_b, slice_sizes, token_lora_slots(inputs))
    return forward


def _host_seq_bounds(inputs, _device) -> dict:
    """The torch chunked kernel loops over sequences: hand it their bounds from the host (no read-back), when the
    inputs carry their lengths there."""
    if len(inputs.q_lens_list) != inputs.cu_seqlens_q.numel() - 1:
        return {}
    return {'seq_bounds': [0, *itertools.accumulate(inputs.q_lens_list)]}


_build_gated_delta_rule = gated_delta_rule_builder(_gdr.chunk_gated_delta_rule, _gdr.recurrent_gated_delta_rule,
                                                   chunk_kwargs=_host_seq_bounds)
_build_causal_conv1d = causal_conv1d_builder(_conv.causal_conv1d)


_BUILDERS = {
    OpType.Embedding: _const(elementwise.embedding),
    OpType.Linear: _const(elementwise.linear),
    OpType.LinearBlockedF8: blocked_fp8_builder(_fp8.linear_blocked_fp8),
    OpType.RMSNorm: _const(elementwise.rms_norm),
    OpType.AddRMSNorm: _const(elementwise.add_rms_norm),
    OpType.RMSNormLinear: _const(elementwise.rms_norm_linear),
    OpType.GatedRMSNorm: _const(elementwise.gated_rms_norm),
    OpType.ApplyRotary: _const(elementwise.apply_rotary),
    OpType.SiluAndMul: _const(elementwise.silu_and_mul),
    OpType.SigmoidGateMul: _const(elementwise.sigmoid_gate_mul),
    OpType.PagedAttention: _build_attention,
    OpType.VisionAttention: _build_vision_attention,
    OpType.GatedDeltaGating: _const(elementwise.gated_delta_gating),
    OpType.GatedDeltaRule: _build_gated_delta_rule,
    OpType.CausalConv1d: _build_causal_conv1d,
    OpType.SoftmaxTopK: _const(moe.softmax_topk),
    OpType.NormRoute: _const(moe.norm_then_route(elementwise.rms_norm_linear, moe.softmax_topk)),
    OpType.MoE: _const(moe.fused_moe),
    OpType.MoEBlockedF8: blocked_fp8_builder(_fp8.fused_moe_blocked_fp8),
    OpType.Sampling: _const(sampling.sample),
    OpType.CacheBlockCopy: _const(_cache_copy.copy_packed_cache),
    OpType.StateSlotCopy: _const(_cache_copy.copy_state_slots),
    OpType.LoRA: _build_lora,
}

BACKEND = Backend('default', _BUILDERS)
