"""Plain-torch sparse MoE experts: group the routed (token, expert) pairs by expert, run each expert that got
tokens once on its gathered rows, and scatter-add the weighted results back. Fine for CPU and as a reference."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...kernels.default.expert_groups import expert_groups


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's tail: float32 softmax over logits [T, E], the top-k (descending), divided by their sum when
    `renormalize` -> (weights [T, k] in logits' dtype, expert ids [T, k] int64)."""
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def fused_moe(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) with SwiGLU experts.

    x [T, H]; gate_up_proj [E, 2I, H] (gate rows first, then up); down_proj [E, H, I]; topk_weights [T, K] (any
    float dtype, applied in x's dtype); topk_ids [T, K] int64. Returns [T, H] in x's dtype.
    """
    out = torch.zeros_like(x)
    for expert_id, rows, weights in expert_groups(topk_ids, topk_weights, gate_up_proj.size(0), x.dtype):
        gate, up = F.linear(x[rows], gate_up_proj[expert_id]).chunk(2, dim=-1)
        hidden = F.linear(F.silu(gate) * up, down_proj[expert_id])
        out.index_add_(0, rows, hidden * weights)
    return out
