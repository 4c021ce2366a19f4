"""Linear layer whose matmul comes from the selected backend; weights in the model dtype or block-wise FP8
(`use_blocked_fp8`, see `blocked_fp8.py`); LoRA adapters attach to it (`nn.lora`).

`fuse_rows` stacks the weights of projections that read the same input into one weight, after loading, so a forward
runs one GEMM for them (`fuse_input_projections`, below). On the H200 a decode step's GEMM costs at least ~4-5 us
inside a CUDA graph whatever its size: Qwen3.5-35B-A3B's per-layer router (64 x 2048), shared-expert gate (1 x
2048) and gated-DeltaNet `in_proj_ba` (64 x 2048) took 5.2 / 4.1 / 5.2 us each for 0.1 us of weight bytes
(`benchmark/bench_decode_gemms.py`, 2026-12-02). The stack is padded with zero rows to a multiple of
`FUSED_ROW_ALIGN`, so its GEMM's output rows stay 16-byte aligned (`unstack` drops the padding): cuBLAS runs an
output of odd width with an align-1 kernel (H100, 2026-12-07: the 35B-A3B shape's 1089-row stack of shared-expert
gate_up + router + shared gate took 17 us a layer at 100 tokens, `cutlass_75_tensorop_..._align1`).
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import nn

from ..backends.base import OpType
from ..backends.selector import current_backend
from .blocked_fp8 import fp8_parameter, scale_parameter


class Linear(nn.Module):

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.weight_scale_inv: nn.Parameter | None = None
        self.weight_block_size: tuple[int, int] | None = None  # set when the weight is block-wise FP8
        self._impl = current_backend().build(OpType.Linear)
        self.lora = None  # a `nn.lora.LoRAStack` once adapters are attached

    def use_blocked_fp8(self, block_size: tuple[int, int]) -> None:
        """Make `weight` FP8 with a `weight_scale_inv` block grid; call before the parameters are materialised."""
        self.weight_block_size = tuple(block_size)
        self.weight = fp8_parameter(self.weight)
        self.weight_scale_inv = scale_parameter(self.weight, self.weight_block_size)
        self._impl = current_backend().build(OpType.LinearBlockedF8, block_size=self.weight_block_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale_inv is not None:
            out = self._impl(x, self.weight, self.weight_scale_inv, self.bias)
        else:
            out = self._impl(x, self.weight, self.bias)
        return out if self.lora is None else self.lora(x, out)


class MergedLinear(Linear):
    """A linear layer whose output rows concatenate several checkpoint projections (`shard_sizes`, in order)."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool = False):
        super().__init__(in_features, sum(shard_sizes), bias)
        self.shard_sizes = list(shard_sizes)


class Embedding(nn.Module):

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self._impl = current_backend().build(OpType.Embedding)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self._impl(ids, self.weight)


def fusable(module: nn.Module) -> bool:
    """A projection `fuse_rows` can stack: a 2-D weight in the model dtype, no bias, no FP8 scales, no LoRA."""
    weight = getattr(module, 'weight', None)
    return (isinstance(weight, torch.Tensor) and weight.dim() == 2 and getattr(module, 'bias', None) is None
            and getattr(module, 'weight_scale_inv', None) is None and getattr(module, 'lora', None) is None)


FUSED_ROW_ALIGN = 8  # rows (elements of an output row): 16 bytes in bf16 / fp16


def unstack(out: torch.Tensor, sizes: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """The outputs of the stacked modules (views, widths `sizes`) in the output of a `fuse_rows` stack's GEMM,
    without its padding columns."""
    sizes = [int(n) for n in sizes]
    return out.split(sizes + [out.shape[-1] - sum(sizes)], dim=-1)[:len(sizes)]


def fuse_rows(modules: Sequence[nn.Module]) -> torch.Tensor | None:
    """Stack the weights of `modules` (projections of one input, `fusable`, equal dtype / device / input width)
    row-wise into one new tensor, zero rows after them up to a multiple of `FUSED_ROW_ALIGN`, and re-point each
    module's `weight` at its rows, so the old tensors are freed and the memory stays the same (but for the
    padding); each module still runs alone on its rows (e.g. once a LoRA adapter attaches to it). Returns the
    stacked weight, or None (nothing changed) when a module does not qualify or fusion is off
    (`LMDEPLOY_FUSE_PROJECTIONS=0`)."""
    if os.environ.get('LMDEPLOY_FUSE_PROJECTIONS', '1') == '0' or len(modules) < 2:
        return None
    if not all(fusable(m) for m in modules):
        return None
    weights = [m.weight for m in modules]
    if len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1:
        return None
    pad = -sum(w.shape[0] for w in weights) % FUSED_ROW_ALIGN
    fused = torch.cat(weights + ([weights[0].new_zeros(pad, weights[0].shape[1])] if pad else []))
    start = 0
    for module, weight in zip(modules, weights):
        module.weight = nn.Parameter(fused[start:start + weight.shape[0]], requires_grad=False)
        start += weight.shape[0]
    return fused


def fuse_input_projections(model: nn.Module) -> int:
    """After loading: every module of `model` with a `fuse_input_projections()` method stacks its projections of a
    shared input (see `fuse_rows`); returns how many did. On CUDA the replaced weights' memory then goes back to the
    device: the caching allocator would otherwise keep it (the stacked tensors are larger than any one of them), and
    the pools are sized from the device's free memory (H200 run 18: 150 KV blocks fewer on the 35B-A3B shape)."""
    fused = sum(bool(m.fuse_input_projections()) for m in model.modules() if hasattr(m, 'fuse_input_projections'))
    if fused and torch.cuda.is_available() and any(p.is_cuda for p in model.parameters()):
        torch.cuda.empty_cache()
    return fused
