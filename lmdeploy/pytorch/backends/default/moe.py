"""Plain-torch sparse MoE experts: group the routed (token, expert) pairs by expert, run each expert that got
tokens once on its gathered rows, and scatter-add the weighted results back. Fine for CPU and as a reference."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...kernels.default.expert_groups import add_gated_shared, expert_groups


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool, shared_logit: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's tail: float32 softmax over logits [T, E], the top-k (descending), divided by their sum when
    `renormalize` -> (weights [T, k] in logits' dtype, expert ids [T, k] int64). With `shared_logit` [T, 1] (a
    shared expert's gate logits) one more column: id E, weight `torch.sigmoid(shared_logit)` (see `fused_moe`)."""
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(logits.dtype)
    if shared_logit is not None:
        weights = torch.cat([weights, torch.sigmoid(shared_logit).to(logits.dtype)], dim=1)
        ids = torch.cat([ids, torch.full_like(ids[:, :1], logits.shape[1])], dim=1)
    return weights, ids


def norm_then_route(norm_linear, route):
    """`OpType.NormRoute` as a backend's `RMSNormLinear` (`norm_linear`) and then its `SoftmaxTopK` (`route`), in
    sequence: (weights, ids, s, h) of a MoE layer's input norm and router. x [T, H] and residual (or None) give the
    residual stream s = x + residual and h = RMSNorm(s); the router's logits are `F.linear(h, rows)` in x's dtype,
    rows [E (+1), H] the router's, with `has_shared` last the shared expert's gate row (`softmax_topk`'s
    `shared_logit`)."""
    def norm_route(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                   zero_centered: bool, rows: torch.Tensor, top_k: int, renormalize: bool, has_shared: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        logits, s, h = norm_linear(x, residual, norm_weight, eps, zero_centered, rows, store_normed=True)
        if has_shared:
            logits, shared_logit = logits.split((logits.shape[-1] - 1, 1), dim=-1)
            weights, ids = route(logits, top_k, renormalize, shared_logit)
        else:
            weights, ids = route(logits, top_k, renormalize)
        return weights, ids, s, h
    return norm_route


def fused_moe(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor] | None = None,
              gated_shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) with SwiGLU experts.

    x [T, H]; gate_up_proj [E, 2I, H] (gate rows first, then up); down_proj [E, H, I]; topk_weights [T, K] (any
    float dtype, applied in x's dtype); topk_ids [T, K] int64. Returns [T, H] in x's dtype. `shared` (gate_up
    [2I_s, H], down [H, I_s]): a shared expert, named by the last column of `topk_ids` (id E) and scaled by the last
    column of `topk_weights`; here computed on its own: the routed sum plus scale * shared(x), each rounded to x's
    dtype as the unfused block does. `gated_shared` (shared [T, H], logit [T, 1]): a shared expert's output computed
    apart, added as ``sigmoid(logit) * shared`` (each op rounded to x's dtype).
    """
    if gated_shared is not None:
        return add_gated_shared(fused_moe(x, gate_up_proj, down_proj, topk_weights, topk_ids, shared), gated_shared)
    if shared is not None:
        routed = fused_moe(x, gate_up_proj, down_proj, topk_weights[:, :-1], topk_ids[:, :-1])
        gate, up = F.linear(x, shared[0]).chunk(2, dim=-1)
        return routed + topk_weights[:, -1:].to(x.dtype) * F.linear(F.silu(gate) * up, shared[1])
    out = torch.zeros_like(x)
    for expert_id, rows, weights in expert_groups(topk_ids, topk_weights, gate_up_proj.size(0), x.dtype):
        gate, up = F.linear(x[rows], gate_up_proj[expert_id]).chunk(2, dim=-1)
        hidden = F.linear(F.silu(gate) * up, down_proj[expert_id])
        out.index_add_(0, rows, hidden * weights)
    return out
