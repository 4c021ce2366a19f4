"""The `default` backend: plain torch, runs on CPU and GPU. Every other backend falls back to it."""
from __future__ import annotations

from ...kernels.default import paged_attention as _attn
from ..base import Backend, OpType
from . import elementwise, sampling


def _const(fn):
    """A builder that ignores construction arguments and returns `fn` itself."""
    def build(**_kwargs):
        return fn
    return build


def _build_attention(**_kwargs):
    def forward(q, k, v, k_cache, v_cache, inputs, scale):
        _attn.fill_kv_cache(k, v, k_cache, v_cache, inputs.slot_mapping)
        return _attn.paged_attention(q, k_cache, v_cache, inputs.block_tables, inputs.q_lens_list,
                                     inputs.kv_lens_list, scale)
    return forward


_BUILDERS = {
    OpType.Embedding: _const(elementwise.embedding),
    OpType.Linear: _const(elementwise.linear),
    OpType.RMSNorm: _const(elementwise.rms_norm),
    OpType.GatedRMSNorm: _const(elementwise.gated_rms_norm),
    OpType.ApplyRotary: _const(elementwise.apply_rotary),
    OpType.SiluAndMul: _const(elementwise.silu_and_mul),
    OpType.PagedAttention: _build_attention,
    OpType.Sampling: _const(sampling.sample),
}

BACKEND = Backend('default', _BUILDERS)
