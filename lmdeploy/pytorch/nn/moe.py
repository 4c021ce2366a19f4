"""Sparse mixture-of-experts: softmax top-k router, SwiGLU experts as stacked weights, optional gated shared expert.

Expert weights are stacked like transformers' fused layout: `gate_up_proj` [E, 2I, H] (gate rows, then up rows)
and `down_proj` [E, H, I]. Checkpoints with per-expert keys (`experts.{e}.gate_proj.weight` ...) load through
`FusedExperts.load_weight`. The expert computation comes from the backend (`OpType.MoE`, or `OpType.MoEBlockedF8`
for block-wise FP8 experts: `use_blocked_fp8`, scales `gate_up_proj_scale_inv` / `down_proj_scale_inv`).

A forward of at most `SparseMoeBlock.fold_max_tokens()` tokens runs the shared expert inside the routed experts'
op as one more expert (id E, its scale the sigmoid gate, one more column from the router), when its per-rank
shapes equal one routed expert's and neither it nor the experts carry LoRA or FP8: the shared expert's two GEMMs,
SiLU-and-mul, gate multiply and add are then no launches of their own. The bound is the backend op's own
(`fold_shared_max_tokens`: the cuda backend's few-token MoE, on unless `LMDEPLOY_MOE_GEMV=0`, runs the shared expert
as one more pair of its two launches, up to 4 tokens), or `FOLD_MAX_TOKENS` with `LMDEPLOY_MOE_FOLD_SHARED=1`
(opt-in; H200 run 13: the kernels' tests pass, an engine's start-up with it did not finish within 100 s, not yet
understood), else none. Larger forwards (prefill, where a plain GEMM runs the shared rows faster) keep the separate
shared expert. When the input projections are stacked (below), a folded forward takes the router's and the shared
gate's logits from one GEMM over their adjacent rows of the stack; from the decoder layer (`forward_normed`) the
layer's post-attention norm, that GEMM and the routing are one op (`TopKRouter.norm_route`, `OpType.NormRoute`: one
launch on the `cuda` backend with `LMDEPLOY_NORM_ROUTE=1`, else the three).

Otherwise, after loading, the shared expert's `gate_up_proj`, the router and the shared-expert gate read the input
through one stacked GEMM (`SparseMoeBlock.fuse_input_projections`, `nn.linear.fuse_rows`) while none of them carries
LoRA.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from ..backends.base import OpType
from ..backends.selector import current_backend
from ..kernels.default.expert_groups import add_gated_shared
from .blocked_fp8 import check_fp8_copy, fp8_parameter, scale_parameter
from .linear import Linear, fusable, fuse_rows, unstack
from .norm import RMSNorm, norm_residual


class TopKRouter(nn.Module):
    """Softmax over expert logits (float32), top-k, optionally renormalised to sum to one per token."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool = True):
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        backend = current_backend()
        self._impl = backend.build(OpType.SoftmaxTopK)  # softmax + top-k + renormalisation, fused
        self._norm_route_impl = backend.build(OpType.NormRoute)

    def forward(self, x: torch.Tensor, shared_logit: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] in x's dtype, expert ids [T, k] int64); with `shared_logit` [T, 1] one more
        column, the shared expert (id E, weight sigmoid(logit): `FusedExperts.forward(shared=...)`)."""
        return self.route(torch.nn.functional.linear(x, self.weight), shared_logit)

    def route(self, logits: torch.Tensor, shared_logit: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` from the expert logits [T, E] (any row stride)."""
        return self._impl(logits, self.top_k, self.norm_topk_prob, shared_logit)

    def norm_route(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, rows: torch.Tensor,
                   has_shared: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights, ids, s, h): `norm` of the residual stream s = x + residual (x when residual is None) as h, then
        `forward`'s routing of h through `rows`, this router's weight as a row slice of a stacked projection (with
        `has_shared` one row more, the shared expert's gate: `forward`'s `shared_logit`), as one op
        (`OpType.NormRoute`: one launch on the `cuda` backend for a few tokens)."""
        return self._norm_route_impl(x, residual, norm.weight, norm.eps, norm.zero_centered, rows, self.top_k,
                                     self.norm_topk_prob, has_shared)


class FusedExperts(nn.Module):

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)
        self.gate_up_proj_scale_inv: nn.Parameter | None = None
        self.down_proj_scale_inv: nn.Parameter | None = None
        self.weight_block_size: tuple[int, int] | None = None  # set when the experts are block-wise FP8
        self._impl = current_backend().build(OpType.MoE)
        # tokens up to which the backend's op runs a folded shared expert best (`SparseMoeBlock.fold_max_tokens`)
        self.fold_shared_max_tokens = int(getattr(self._impl, 'fold_shared_max_tokens', 0))

    def use_blocked_fp8(self, block_size: tuple[int, int]) -> None:
        """FP8 expert weights with block scales; call before the parameters are materialised. The gate and up rows
        of `gate_up_proj` share one scale grid, so `intermediate_size` must be a multiple of the block rows."""
        if self.intermediate_size % block_size[0]:
            raise ValueError(f'FP8 experts need intermediate_size ({self.intermediate_size}) to be a multiple of the '
                             f'block rows ({block_size[0]})')
        self.weight_block_size = tuple(block_size)
        self.gate_up_proj = fp8_parameter(self.gate_up_proj)
        self.down_proj = fp8_parameter(self.down_proj)
        self.gate_up_proj_scale_inv = scale_parameter(self.gate_up_proj, self.weight_block_size)
        self.down_proj_scale_inv = scale_parameter(self.down_proj, self.weight_block_size)
        self._impl = current_backend().build(OpType.MoEBlockedF8, block_size=self.weight_block_size)
        self.fold_shared_max_tokens = 0

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                shared: tuple[torch.Tensor, torch.Tensor] | None = None,
                gated_shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """`shared` (gate_up [2I, H], down [H, I]): a shared expert run as expert id E, named by the last column
        of `topk_ids` (bf16 / fp16 / fp32 experts only). `gated_shared` (out [T, H], logit [T, 1]): a shared
        expert's output computed apart, added as ``sigmoid(logit) * out`` by the op (on `cuda` in the launch that
        sums the routed outputs unless `LMDEPLOY_MOE_COMBINE=0`)."""
        if shared is not None:
            return self._impl(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids, shared=shared)
        if self.weight_block_size is not None:
            out = self._impl(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids,
                             self.gate_up_proj_scale_inv, self.down_proj_scale_inv)
            return add_gated_shared(out, gated_shared)
        return self._impl(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids, gated_shared=gated_shared)

    def load_weight(self, key: str, tensor: torch.Tensor) -> list[str]:
        """Copy one checkpoint tensor addressed relative to this module; returns the parameter names written.

        Accepts per-expert keys `{e}.gate_proj.weight`, `{e}.up_proj.weight`, `{e}.down_proj.weight` and the fused
        `gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I] (also stored transposed, as some exports do), and for FP8
        experts their scales (`{e}.gate_proj.weight_scale_inv`, `gate_up_proj_scale_inv`, ...).
        """
        parts = key.split('.')
        if key in ('gate_up_proj', 'down_proj', 'gate_up_proj_scale_inv', 'down_proj_scale_inv'):
            param = getattr(self, key)
            if param is None:
                raise ValueError(f'unexpected expert weight {key!r}: these experts are not FP8')
            if tensor.shape != param.shape and tensor.transpose(1, 2).shape == param.shape \
                    and self.weight_block_size is None:
                tensor = tensor.transpose(1, 2)
            _copy(param.data, tensor, key)
            return [key]
        if len(parts) == 3 and parts[0].isdigit() and parts[2] in ('weight', 'weight_scale_inv'):
            expert_id, proj, suffix = int(parts[0]), parts[1], parts[2]
            if not 0 <= expert_id < self.num_experts:
                raise ValueError(f'expert weight {key!r}: expert id out of range [0, {self.num_experts})')
            is_scale = suffix == 'weight_scale_inv'
            if is_scale and self.weight_block_size is None:
                raise ValueError(f'unexpected expert weight {key!r}: these experts are not FP8')
            rows = self.intermediate_size // (self.weight_block_size[0] if is_scale else 1)
            gate_up = self.gate_up_proj_scale_inv if is_scale else self.gate_up_proj
            name = 'gate_up_proj_scale_inv' if is_scale else 'gate_up_proj'
            if proj == 'gate_proj':
                _copy(gate_up.data[expert_id, :rows], tensor, key)
                return [name]
            if proj == 'up_proj':
                _copy(gate_up.data[expert_id, rows:], tensor, key)
                return [name]
            if proj == 'down_proj':
                down = self.down_proj_scale_inv if is_scale else self.down_proj
                _copy(down.data[expert_id], tensor, key)
                return ['down_proj_scale_inv' if is_scale else 'down_proj']
        raise ValueError(f'unexpected expert weight {key!r}')


def _copy(target: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if target.shape != tensor.shape:
        raise ValueError(f'weight {name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(target.shape)}')
    check_fp8_copy(target, tensor, name)
    target.copy_(tensor.to(target.dtype))


_FOLD_SHARED = os.environ.get('LMDEPLOY_MOE_FOLD_SHARED', '0') == '1'
FOLD_MAX_TOKENS = 256


class SparseMoeBlock(nn.Module):
    """Routed experts plus an optional shared expert scaled by sigmoid(shared_expert_gate(x)).

    Submodule names follow the Qwen-MoE checkpoints: `gate`, `experts`, `shared_expert`, `shared_expert_gate`.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 norm_topk_prob: bool = True, shared_expert: nn.Module | None = None):
        super().__init__()
        self.gate = TopKRouter(hidden_size, num_experts, top_k, norm_topk_prob)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size)
        self.shared_expert = shared_expert
        self.shared_expert_gate = Linear(hidden_size, 1) if shared_expert is not None else None
        self._fused_in: torch.Tensor | None = None  # set after loading (fuse_input_projections)

    def fuse_input_projections(self) -> bool:
        """After loading: the shared expert's `gate_up_proj`, the router and the shared-expert gate as one GEMM
        [2I + E + 1, H] (`nn.linear.fuse_rows`), when the shared expert is a plain SwiGLU MLP."""
        gate_up = getattr(self.shared_expert, 'gate_up_proj', None)
        if gate_up is None or not all(hasattr(self.shared_expert, n) for n in ('act', 'down_proj')):
            return False
        self._fused_in = fuse_rows([gate_up, self.gate, self.shared_expert_gate])
        return self._fused_in is not None

    def _stacked_weight(self, folded: bool) -> torch.Tensor | None:
        """The rows of the stacked input projection (see `fuse_input_projections`) a forward runs as one GEMM: with
        a folded shared expert the router's and the shared gate's (adjacent), else all of them while no LoRA
        adapter has attached to the shared expert's projections since; None when the projections are not
        stacked."""
        if self._fused_in is None:
            return None
        if folded:  # the router's and the shared gate's rows (the padding after them left out)
            start = self.shared_expert.gate_up_proj.weight.shape[0]
            return self._fused_in[start:start + self.gate.weight.shape[0] + 1]
        if self.shared_expert.gate_up_proj.lora is not None or self.shared_expert_gate.lora is not None:
            return None
        return self._fused_in

    def forward(self, x: torch.Tensor, routes_out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]. `routes_out` [T, top_k] (any integer dtype), when given, receives the expert ids the
        router chose for each token (the routed-experts record; it costs one small copy)."""
        shared = self.foldable_shared(x.shape[0])
        stacked = self._stacked_weight(shared is not None)
        projected = None if stacked is None else self.shared_expert.gate_up_proj._impl(x, stacked, None)
        return self._forward_projected(x, projected, shared, routes_out)

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                       routes_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward(h), s) for h = norm(s), s = x + residual: with stacked input projections the norm and their
        GEMM are one op (`RMSNorm.linear`, which also hands back h for the experts)."""
        shared = self.foldable_shared(x.shape[0])
        stacked = self._stacked_weight(shared is not None)
        if stacked is None:
            h, residual = norm_residual(norm, x, residual)
            return self.forward(h, routes_out), residual
        if shared is not None:  # the stacked rows are the router's and the shared gate's: norm and routing as one op
            weights, ids, residual, h = self.gate.norm_route(x, residual, norm, stacked, has_shared=True)
            return self._forward_routed(h, weights, ids, shared, routes_out), residual
        projected, residual, h = norm.linear(x, residual, stacked, need_normed=True)
        return self._forward_projected(h, projected, shared, routes_out), residual

    def _forward_projected(self, x: torch.Tensor, projected: torch.Tensor | None,
                           shared: tuple[torch.Tensor, torch.Tensor] | None,
                           routes_out: torch.Tensor | None) -> torch.Tensor:
        """`forward` given the stacked projection of x (`_stacked_weight`'s rows; None: not stacked)."""
        if shared is not None:
            if projected is not None:
                weights, ids = self.gate.route(*projected.split((projected.shape[-1] - 1, 1), dim=-1))
            else:
                weights, ids = self.gate(x, shared_logit=self.shared_expert_gate(x))
            return self._forward_routed(x, weights, ids, shared, routes_out)
        if projected is not None:
            sizes = (self.shared_expert.gate_up_proj.weight.shape[0], self.gate.weight.shape[0], 1)
            shared_gate_up, logits, shared_logit = unstack(projected, sizes)
            weights, ids = self.gate.route(logits)
        else:
            weights, ids = self.gate(x)
        if routes_out is not None:
            routes_out.copy_(ids)
        gated = None  # the shared expert's output and gate logit, added inside the experts' op
        if projected is not None:
            gated = (self.shared_expert.down_proj(self.shared_expert.act(shared_gate_up)), shared_logit)
        elif self.shared_expert is not None:
            gated = (self.shared_expert(x), self.shared_expert_gate(x))
        return self.experts(x, weights, ids, gated_shared=gated)

    def _forward_routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                        shared: tuple[torch.Tensor, torch.Tensor], routes_out: torch.Tensor | None) -> torch.Tensor:
        """The experts with the shared one folded in (`foldable_shared`), given the routing (its last column the
        shared expert's)."""
        if routes_out is not None:
            routes_out.copy_(ids[:, :-1])
        return self.experts(x, weights, ids, shared=shared)

    def fold_max_tokens(self) -> int:
        """Forwards of up to this many tokens fold the shared expert in where they can (`foldable_shared`): 0 none."""
        return FOLD_MAX_TOKENS if _FOLD_SHARED else self.experts.fold_shared_max_tokens

    def foldable_shared(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The shared expert's (gate_up, down) weights when a forward of `num_tokens` tokens runs it inside the
        experts' op (see the module docstring), else None."""
        limit = self.fold_max_tokens()
        if not limit or num_tokens > limit or self.shared_expert is None:
            return None
        gate_up, down = (getattr(self.shared_expert, name, None) for name in ('gate_up_proj', 'down_proj'))
        experts = self.experts
        linears = (gate_up, down, self.shared_expert_gate)
        if any(not isinstance(m, Linear) or not fusable(m) for m in linears) or experts.weight_block_size is not None:
            return None
        w_gate_up, w_down = gate_up.weight, down.weight
        if (w_gate_up.shape != experts.gate_up_proj.shape[1:] or w_down.shape != experts.down_proj.shape[1:]
                or w_gate_up.dtype != experts.gate_up_proj.dtype or w_down.stride() != experts.down_proj.stride()[1:]
                or w_gate_up.stride() != experts.gate_up_proj.stride()[1:]):
            return None
        return w_gate_up, w_down
