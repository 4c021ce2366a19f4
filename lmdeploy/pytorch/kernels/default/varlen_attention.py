"""Reference non-causal variable-length attention (torch): each packed sequence attends within itself only."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int], scale: float
                     ) -> torch.Tensor:
    """q, k, v [N, H, D], sequence b in rows [cu_seqlens[b], cu_seqlens[b + 1]) (host list) -> [N, H, D]."""
    out = torch.empty_like(q)
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        if end > start:
            q_b, k_b, v_b = (x[start:end].transpose(0, 1) for x in (q, k, v))
            out[start:end] = F.scaled_dot_product_attention(q_b, k_b, v_b, scale=scale).transpose(0, 1)
    return out
