"""Pure-torch paged attention over a packed KV pool: KV fill and varlen attention with cached context.

These are the references the Triton kernels are tested against, and the `default` backend's implementation.
"""
from __future__ import annotations

import torch


def fill_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Write new tokens' K/V ([T, H, D]) into the pool at `slot_mapping` (page * page_size + offset); a negative
    slot (padding) writes nothing, as in the CUDA kernels."""
    page_size = k_cache.size(1)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    pages, offsets = slots // page_size, slots % page_size
    k_cache[pages, offsets] = k[keep].to(k_cache.dtype)
    v_cache[pages, offsets] = v[keep].to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, pages: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The first `kv_len` tokens of a sequence whose pages are `pages`: [kv_len, H, D]."""
    return cache[pages].flatten(0, 1)[:kv_len]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    q_lens: list[int], kv_lens: list[int], scale: float) -> torch.Tensor:
    """Causal attention of packed queries `q` [T, Hq, D] over each sequence's cached K/V (new tokens included).

    Query i of sequence b sits at position `kv_lens[b] - q_lens[b] + i` and sees keys at positions <= its own.
    """
    out = torch.empty_like(q)
    page_size = k_cache.size(1)
    num_heads, num_kv_heads = q.size(1), k_cache.size(2)
    start = 0
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        if q_len == 0:
            continue
        num_pages = -(-kv_len // page_size)
        pages = block_tables[b, :num_pages]
        k = gather_kv(k_cache, pages, kv_len).to(q.dtype)
        v = gather_kv(v_cache, pages, kv_len).to(q.dtype)
        if num_kv_heads != num_heads:
            k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
            v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        q_b = q[start:start + q_len]
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
        mask = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]
        attn = torch.nn.functional.scaled_dot_product_attention(
            q_b.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale)
        out[start:start + q_len] = attn.transpose(0, 1)
        start += q_len
    return out
