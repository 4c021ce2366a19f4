"""Block-wise FP8 weights (the format of the official `-FP8` releases), as a weight variant of `Linear` and
`FusedExperts`.

A quantized weight `W [..., N, K]` is stored as `float8_e4m3fn` next to `weight_scale_inv [..., ceil(N / bn),
ceil(K / bk)]` (float32) for `block_size = (bn, bk)`; the real weight is `W[n, k] * scale_inv[n // bn, k // bk]`.
A layer switches to this variant with `use_blocked_fp8(block_size)` before its parameters are materialised
(the loader does it on a model whose parameters are still on the meta device), so the bf16 copy never exists.
"""
from __future__ import annotations

import torch
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn


def scale_grid(rows: int, cols: int, block_size: tuple[int, int]) -> tuple[int, int]:
    """Shape of the `weight_scale_inv` of a `[rows, cols]` weight."""
    return -(-rows // block_size[0]), -(-cols // block_size[1])


def fp8_parameter(like: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(torch.empty(like.shape, dtype=FP8_DTYPE, device=like.device), requires_grad=False)


def scale_parameter(like: torch.Tensor, block_size: tuple[int, int]) -> nn.Parameter:
    shape = (*like.shape[:-2], *scale_grid(like.shape[-2], like.shape[-1], block_size))
    return nn.Parameter(torch.empty(shape, dtype=torch.float32, device=like.device), requires_grad=False)


def check_fp8_copy(target: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    """An FP8 tensor only ever lands in an FP8 parameter, and vice versa: anything else would drop the scales or
    quantize without them."""
    if (target.dtype == FP8_DTYPE) != (tensor.dtype == FP8_DTYPE):
        raise ValueError(f'weight {name}: checkpoint dtype {tensor.dtype} cannot be copied into a {target.dtype} '
                         'parameter (FP8 weights need their weight_scale_inv)')


def dequantize_blocked_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int],
                           dtype: torch.dtype) -> torch.Tensor:
    """`weight [..., N, K]` (FP8) times its block scales, in float32, rounded once to `dtype` (edge blocks may be
    partial). Raises `ValueError` if `scale_inv` is not the grid of `block_size` over the weight."""
    rows, cols = weight.shape[-2:]
    expected = (*weight.shape[:-2], *scale_grid(rows, cols, block_size))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f'weight_scale_inv shape {tuple(scale_inv.shape)} != {expected} for a weight of shape '
                         f'{tuple(weight.shape)} in blocks of {tuple(block_size)}')
    scale = scale_inv.float().repeat_interleave(block_size[0], dim=-2)[..., :rows, :]
    scale = scale.repeat_interleave(block_size[1], dim=-1)[..., :cols]
    return (weight.float() * scale).to(dtype)


def fp8_linear_shapes(model: nn.Module) -> set[tuple[int, int, tuple[int, int]]]:
    """(N, K, block_size) of every block-wise FP8 linear of `model` (its GEMM shapes; experts are 3-D and not
    included)."""
    return {(m.weight.shape[0], m.weight.shape[1], m.weight_block_size) for m in model.modules()
            if getattr(m, 'weight_scale_inv', None) is not None and m.weight.dim() == 2}
