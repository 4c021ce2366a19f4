"""Plain-torch implementations of the small per-token ops (norms, rotary, gated DeltaNet gating, activations,
linear, embedding)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    """RMSNorm in float32; `zero_centered` scales by (1 + weight) as Qwen3-Next/Qwen3.5 do."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float() + 1.0 if zero_centered else weight.float()
    return (x32 * w).to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 zero_centered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual stream's add, then the next norm, with the sum in x's
    dtype (the unfused pair of ops)."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps, zero_centered), new_residual


def norm_then_linear(norm, add_norm, linear):
    """`rms_norm_linear`'s semantics as a backend's own norm (`norm`, `add_norm`: `rms_norm` / `add_rms_norm`'s
    signatures) and then its linear (`linear(h, weight)`), the two ops in sequence (h returned always)."""
    def rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                        zero_centered: bool, weight: torch.Tensor, store_normed: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if residual is None:
            h, s = norm(x, norm_weight, eps, zero_centered), x
        else:
            h, s = add_norm(x, residual, norm_weight, eps, zero_centered)
        return linear(h, weight), s, h
    return rms_norm_linear


rms_norm_linear = norm_then_linear(rms_norm, add_rms_norm, F.linear)
rms_norm_linear.__doc__ = """(`F.linear(h, weight)`, s, h) with s = x + residual (x itself when residual is None) and
h = rms_norm(s): a norm and the projection that reads it as one op (`OpType.RMSNormLinear`); here the two ops in
sequence, which return h whatever `store_normed` asks."""


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rmsnorm(x) * silu(gate), normalised in float32 (the gated DeltaNet output norm)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    x32 = weight.float() * x32
    return (x32 * F.silu(gate.float())).to(dtype)


def gated_delta_gating(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) from the per-head projections a, b [T, H]: g = -exp(A_log) * softplus(a + dt_bias) in float32
    (log-space decay, <= 0), beta = sigmoid(b)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.sigmoid()


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary on the first `rotary_dim = cos.size(-1)` features of q [T, Hq, D] and k [T, Hk, D]."""
    rotary_dim = cos.size(-1)
    cos = cos[:, None, :]
    sin = sin[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
        x1, x2 = x_rot.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
        out = (x_rot.float() * cos + rotated.float() * sin).to(x.dtype)
        return torch.cat((out, x_pass), dim=-1) if x_pass.numel() else out

    return rotate(q), rotate(k)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:], each op rounded to x's dtype (transformers' MLP)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def sigmoid_gate_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate), each op rounded to x's dtype (transformers' gated attention output)."""
    return x * torch.sigmoid(gate)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, weight)
