"""The paged KV pool of the Triton cache and attention kernel tests: a packed page pool as `CacheEngine` builds it
(strided K / V views), NaN in every token slot no sequence owns, so a kernel that reads past `kv_len` or through a
padded block-table entry fails loudly."""
from __future__ import annotations

import torch

DTYPES = {'bf16': torch.bfloat16, 'fp16': torch.float16, 'fp32': torch.float32}


def make_kv_pool(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A NaN-filled packed pool `[P, page_bytes]` and its strided K and V views `[P, kbs, H, D]`."""
    elem = torch.empty((), dtype=dtype).element_size()
    pool = torch.empty(num_pages, 2 * page_size * num_kv_heads * head_dim * elem, dtype=torch.uint8, device=device)
    pages = pool.view(dtype).view(num_pages, 2, page_size, num_kv_heads, head_dim)
    pages.fill_(float('nan'))
    return pool, pages[:, 0], pages[:, 1]


def assign_pages(kv_lens: list[int], page_size: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Block tables `[B, max_pages]` of shuffled distinct pages (padded with 0) and the pool size they need."""
    counts = [-(-n // page_size) for n in kv_lens]
    num_pages = sum(counts) + 3  # spare pages stay NaN
    order = torch.randperm(num_pages, generator=gen)
    tables = torch.zeros(len(kv_lens), max([*counts, 1]), dtype=torch.int64)
    start = 0
    for b, count in enumerate(counts):
        tables[b, :count] = order[start:start + count]
        start += count
    return tables, num_pages


def fill_history(k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, kv_lens: list[int],
                 gen: torch.Generator) -> None:
    """Random K/V for every owned token slot (positions < kv_len); everything else stays NaN."""
    page_size, num_kv_heads, head_dim = k_cache.shape[1:]
    for b, kv_len in enumerate(kv_lens):
        pos = torch.arange(kv_len)
        pages, offsets = tables[b, pos // page_size].to(k_cache.device), (pos % page_size).to(k_cache.device)
        for cache in (k_cache, v_cache):
            cache[pages, offsets] = torch.randn(kv_len, num_kv_heads, head_dim, generator=gen).to(cache)
