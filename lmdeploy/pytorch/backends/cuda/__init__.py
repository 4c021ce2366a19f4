"""The `cuda` backend: Triton kernels (and fla-core for the gated delta rule); anything missing falls back to the
`default` backend op by op."""
from __future__ import annotations

from ...kernels.cuda.copy_packed_cache import copy_packed_cache
from ...kernels.cuda.fill_kv_cache import fill_kv_cache
from ...kernels.cuda.paged_attention import paged_decode_attention, paged_prefill_attention
from ..base import Backend, OpType
from ..default import BACKEND as DEFAULT_BACKEND


def _const(fn):
    def build(**_kwargs):
        return fn
    return build


def _build_attention(**_kwargs):
    def forward(q, k, v, k_cache, v_cache, inputs, scale):
        fill_kv_cache(k, v, k_cache, v_cache, inputs.slot_mapping)
        if inputs.is_decode:
            return paged_decode_attention(q, k_cache, v_cache, inputs.block_tables, inputs.kv_lens, scale)
        return paged_prefill_attention(q, k_cache, v_cache, inputs.block_tables, inputs.cu_seqlens_q,
                                       inputs.q_lens, inputs.kv_lens, inputs.max_seqlen_q, scale)
    return forward


_BUILDERS = {
    OpType.PagedAttention: _build_attention,
    OpType.CacheBlockCopy: _const(copy_packed_cache),
}

BACKEND = Backend('cuda', _BUILDERS, parent=DEFAULT_BACKEND)
