"""Routed (token, expert) pairs grouped by expert, for the plain-torch MoE paths (bf16 and FP8 experts); and the
gated shared expert's add every MoE path without a fused one uses."""
from __future__ import annotations

from collections.abc import Iterator

import torch


def expert_groups(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, dtype: torch.dtype
                  ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(expert id, token rows [n], routing weights [n, 1] in `dtype`) for every expert that got tokens, in expert
    order; within an expert, rows keep their (token, k) order (a stable sort), so results are reproducible."""
    top_k = topk_ids.size(1)
    flat_ids = topk_ids.reshape(-1)
    order = flat_ids.argsort(stable=True)
    token_of = order // top_k
    weights = topk_weights.reshape(-1)[order].to(dtype)
    start = 0
    for expert_id, count in enumerate(torch.bincount(flat_ids, minlength=num_experts).tolist()):
        if count:
            yield expert_id, token_of[start:start + count], weights[start:start + count, None]
        start += count


def add_gated_shared(out: torch.Tensor, gated_shared: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """``out + sigmoid(logit) * shared`` for `gated_shared` = (shared [T, H], logit [T, 1]) in torch ops, each
    rounded to out's dtype as the unfused MoE block did; `out` itself when None."""
    if gated_shared is None:
        return out
    shared, logit = gated_shared
    return out + torch.sigmoid(logit) * shared
