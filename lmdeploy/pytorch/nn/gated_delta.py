"""Gated DeltaNet building blocks: the short causal convolution, the gating, and the gated delta rule itself.

Both stateful ops continue every sequence from its row of the state pool (`ctx.inputs.state_ids`, or from zeros
when `ctx.inputs.is_fresh`) and leave the state after the fed tokens in that row, so chunked prefill, decode and
mixed batches all compose. Implementations come from the backend (`OpType.CausalConv1d`, `OpType.GatedDeltaRule`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..backends.base import OpType
from ..backends.selector import current_backend
from ..model_inputs import ModelInputs


class CausalConv1d(nn.Module):
    """Depthwise causal conv over packed varlen tokens; keeps the last `kernel_size - 1` inputs per sequence.

    The weight keeps the checkpoint's `nn.Conv1d` shape `[channels, 1, kernel_size]`.
    """

    def __init__(self, channels: int, kernel_size: int, bias: bool = False, activation: str | None = 'silu'):
        super().__init__()
        self.channels = channels
        self.kernel_size = kernel_size
        self.activation = activation
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(channels), requires_grad=False) if bias else None
        self._impl = current_backend().build(OpType.CausalConv1d)

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
        """x [T, C], conv_state pool [num_slots, C, K-1] -> [T, C]."""
        return self._impl(x, self.weight.squeeze(1), self.bias, conv_state, inputs, self.activation)


def gated_delta_gating(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) from the per-head projections a, b [T, H]: g = -exp(A_log) * softplus(a + dt_bias) in float32
    (log-space decay, <= 0), beta = sigmoid(b)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.sigmoid()


class GatedDeltaRule(nn.Module):
    """The gated delta rule over packed varlen sequences (no parameters).

    q, k [T, Hk, Dk]; v [T, H, Dv] with H a multiple of Hk (value head h reads key head h // (H // Hk));
    g, beta [T, H]; state pool [num_slots, H, Dk, Dv]. The backend picks the recurrent form for pure decode
    batches and the chunked form otherwise.
    """

    def __init__(self, use_qk_l2norm: bool = True):
        super().__init__()
        self.use_qk_l2norm = use_qk_l2norm
        self._impl = current_backend().build(OpType.GatedDeltaRule)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
        return self._impl(q, k, v, g, beta, state, inputs, use_qk_l2norm=self.use_qk_l2norm)
