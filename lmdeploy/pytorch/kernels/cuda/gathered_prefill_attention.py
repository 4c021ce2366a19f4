"""Long eager prefills: each sequence's K/V gathered from the paged pool into contiguous tensors, then torch SDPA on
its flash backend (reference: `kernels/default/paged_attention.py`).

For a chunk of thousands of queries the attention is compute-bound and the gather (one copy of the context's K/V,
`benchmark/bench_prefill_attention.py` times it) costs little beside it, so the field's kernel can run on the
contiguous copy. Query `i` of sequence `b` sits at position `kv_len - q_len + i`: the causal mask is aligned to the
bottom right (`causal_lower_right`), which is the flash kernel's own alignment, and GQA runs natively
(`enable_gqa`). The loop over sequences reads the host lengths, so this path is for eager forwards only (never
inside a CUDA graph, whose host lists are placeholders); it does not synchronise.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# Use the gathered path only for chunks of at least this many query tokens (below it the paged kernel's launch is
# cheaper than gathering) and batches of at most this many sequences (one SDPA launch per sequence).
GATHER_MIN_TOKENS = 2048
GATHER_MAX_SEQS = 4


def use_gathered_prefill(q_lens: list[int], is_exact: bool) -> bool:
    """Whether a prefill with these host query lengths takes the gathered path (`is_exact`: the host lists are the
    real lengths, i.e. an eager forward)."""
    return is_exact and 0 < len(q_lens) <= GATHER_MAX_SEQS and max(q_lens) >= GATHER_MIN_TOKENS


def gathered_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, q_lens: list[int], kv_lens: list[int],
                               scale: float) -> torch.Tensor:
    """Causal attention of packed queries `q` [T, Hq, D] over each sequence's paged K/V (new tokens included);
    `q_lens` / `kv_lens` are the host lengths. Returns [T, Hq, D] in q's dtype."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    out = torch.empty_like(q)
    page_size = k_cache.size(1)
    start = 0
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
        if q_len == 0:
            continue
        pages = block_tables[b, :-(-kv_len // page_size)]
        k = k_cache[pages].flatten(0, 1)[:kv_len].transpose(0, 1)[None]
        v = v_cache[pages].flatten(0, 1)[:kv_len].transpose(0, 1)[None]
        q_b = q[start:start + q_len].transpose(0, 1)[None]
        mask = {'is_causal': True} if q_len == kv_len else {'attn_mask': causal_lower_right(q_len, kv_len)}
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            attn = F.scaled_dot_product_attention(q_b, k.to(q.dtype), v.to(q.dtype), scale=scale, enable_gqa=True,
                                                  **mask)
        out[start:start + q_len] = attn[0].transpose(0, 1)
        start += q_len
    return out
