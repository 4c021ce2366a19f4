"""Block-wise FP8 GEMMs in plain torch: the reference for the Triton kernels (`kernels/cuda/blocked_fp8*.py`) and the
`default` backend's implementation.

Scheme (W8A8, as DeepSeek-V3 / Qwen FP8 releases are served): weights FP8 with one float32 scale per
`[bn, bk]` block; activations quantized on the fly per token and group of `bk` channels (scale = group amax / 448),
products accumulated in float32, rounded once to the activation dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .expert_groups import expert_groups

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
_EPS = 1e-10


def quant_fp8(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (FP8 [M, K], float32 scales [M, ceil(K / group_size)]); x ~= q * scale per group."""
    rows, cols = x.shape
    groups = -(-cols // group_size)
    padded = F.pad(x.float(), (0, groups * group_size - cols)).view(rows, groups, group_size)
    scale = padded.abs().amax(dim=-1).clamp(min=_EPS) / FP8_MAX
    q = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(rows, -1)[:, :cols], scale


def _expand(scale: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    return scale.repeat_interleave(block[0], dim=-2)[..., :shape[0], :].repeat_interleave(block[1], dim=-1)[
        ..., :shape[1]]


def blocked_gemm_fp8(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                     block_size: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K] FP8 with per-(row, bk group) scales `a_scale [M, ceil(K / bk)]`; b [N, K] FP8 with `b_scale
    [ceil(N / bn), ceil(K / bn)]`. Returns a @ b.T [M, N] in `out_dtype` (float32 accumulation)."""
    a_real = a.float() * _expand(a_scale.float(), (1, block_size[1]), tuple(a.shape))
    b_real = b.float() * _expand(b_scale.float(), block_size, tuple(b.shape))
    return (a_real @ b_real.T).to(out_dtype)


def linear_blocked_fp8(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                       bias: torch.Tensor | None, block_size: tuple[int, int]) -> torch.Tensor:
    """y = x W^T (+ b) for an FP8 weight with block scales; x [..., K] in bf16 / fp16 / fp32, y in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    q, scale = quant_fp8(rows, block_size[1])
    out = blocked_gemm_fp8(q, scale, weight, weight_scale_inv, block_size, x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def fused_moe_blocked_fp8(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                          topk_weights: torch.Tensor, topk_ids: torch.Tensor, gate_up_scale: torch.Tensor,
                          down_scale: torch.Tensor, block_size: tuple[int, int]) -> torch.Tensor:
    """`backends/default/moe.fused_moe` with FP8 experts: gate_up_proj [E, 2I, H] / down_proj [E, H, I] FP8 with
    scales [E, ceil(2I / bn), ceil(H / bk)] / [E, ceil(H / bn), ceil(I / bk)]; x and the SwiGLU output are
    quantized per token group before each GEMM. Returns [T, H] in x's dtype."""
    out = torch.zeros_like(x)
    if topk_ids.size(0) == 0:
        return out
    xq, x_scale = quant_fp8(x, block_size[1])
    for expert_id, rows, weights in expert_groups(topk_ids, topk_weights, gate_up_proj.size(0), x.dtype):
        gate_up = blocked_gemm_fp8(xq[rows], x_scale[rows], gate_up_proj[expert_id], gate_up_scale[expert_id],
                                   block_size, x.dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        act = (F.silu(gate.float()) * up.float()).to(x.dtype)
        aq, a_scale = quant_fp8(act, block_size[1])
        hidden = blocked_gemm_fp8(aq, a_scale, down_proj[expert_id], down_scale[expert_id], block_size, x.dtype)
        out.index_add_(0, rows, hidden * weights)
    return out
