"""Routed SwiGLU experts through torch's grouped GEMM (`torch.nn.functional.grouped_mm`, `torch._grouped_mm` before
it was public; CUTLASS kernels with TMA loads on Hopper); semantics of `backends/default/moe.py`.

`moe.py`'s Triton kernels stay 1.7-2.6x their floor from ~1K tokens up, slower than `torch.bmm` over the same rows
per expert (H100 run 65, H200 runs 13 and 53): the grouped-GEMM speed a prefill's experts chase. This path hands
the two GEMMs to torch's grouped GEMM and keeps only the cheap steps around them:

1. the (token, expert) pairs sorted by expert (a stable sort, so rows keep their (token, k) order) and each
   expert's end offset in the sorted order (`searchsorted`, int32, the grouped GEMM's ``offs``);
2. the pairs' token rows gathered in that order (one `index_select`);
3. gate and up projections for all experts in one grouped GEMM; `silu(gate) * up` (`activation.silu_and_mul`);
4. the down projection in one grouped GEMM;
5. each sorted row scaled by its pair's routing weight and written to the pair's row of a [T * top_k, H] buffer
   (`_unpermute_kernel`), then the top-k rows summed (`moe.combine_pairs` with a gated shared expert).

Rounding follows the reference step by step: each projection's output, the activation, the product, the weighted
row rounded to the dtype; the top-k sum in float32. No host sync (sizes come from shapes, offsets stay on the
device), so it is capturable in a CUDA graph. An expert with no rows is an empty group.

Off unless ``LMDEPLOY_MOE_GROUPED_MM=<tokens>`` names the smallest forward (in tokens) that takes it (`moe.fused_moe`
dispatches; bf16 experts on a device of compute capability 9 or more). `benchmark/bench_moe_kernel.py --grouped`
times it against the Triton kernels.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .activation import silu_and_mul
from .launch import fast_kernel, wait_for_inputs

_GROUPED_MM = getattr(F, 'grouped_mm', None) or getattr(torch, '_grouped_mm', None)
_BLOCK_H = 1024


def min_tokens() -> int:
    """The smallest forward (in tokens) `moe.fused_moe` hands to this path: ``LMDEPLOY_MOE_GROUPED_MM``, 0 (off)
    when unset (`moe.py` reads it at import)."""
    raw = os.environ.get('LMDEPLOY_MOE_GROUPED_MM', '0') or '0'
    try:
        value = int(raw)
    except ValueError as exc:
        raise ValueError(f'LMDEPLOY_MOE_GROUPED_MM={raw!r}: expected a token count (0 = off)') from exc
    if value < 0:
        raise ValueError(f'LMDEPLOY_MOE_GROUPED_MM={raw!r}: expected a token count >= 0 (0 = off)')
    return value


@functools.cache
def _device_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def supported(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> bool:
    """Whether this path runs these experts: torch has a grouped GEMM; bf16 on a CUDA device of compute capability
    9+ (CPU too, for tests); contiguous weights whose rows are whole 16-byte units (the GEMM's TMA loads)."""
    if _GROUPED_MM is None or x.dtype != torch.bfloat16:
        return False
    if x.device.type == 'cuda':
        if not _device_ok(torch.cuda.current_device() if x.device.index is None else x.device.index):
            return False
    elif x.device.type != 'cpu':
        return False
    hidden, inter = down_proj.shape[1], down_proj.shape[2]
    aligned = all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (gate_up_proj, down_proj))
    return aligned and hidden % 8 == 0 and inter % 8 == 0 and gate_up_proj.dtype == down_proj.dtype == x.dtype


@fast_kernel
@triton.jit
def _unpermute_kernel(src_ptr, order_ptr, weights_ptr, out_ptr, hidden, BLOCK_H: tl.constexpr,
                      PDL: tl.constexpr = False):
    """Program (sorted row, column block): row `order[row]` of out = src[row] * weights[order[row]], the weight in
    the output dtype, the product rounded to it (`moe.store_routed`'s rounding)."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden
    pair = tl.load(order_ptr + row).to(tl.int64)
    route = tl.load(weights_ptr + pair).to(out_ptr.dtype.element_ty).to(tl.float32)
    y = tl.load(src_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32) * route
    tl.store(out_ptr + pair * hidden + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def sort_pairs(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [N]: pair indices sorted by expert, stable; offs [E] int32: each expert's end in that order)."""
    sorted_ids, order = torch.sort(topk_ids.reshape(-1), stable=True)
    experts = torch.arange(num_experts, device=topk_ids.device, dtype=sorted_ids.dtype)
    return order, torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)


def per_pair_outputs(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """[T * top_k, H]: row t * top_k + k is topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) (see the module
    docstring; `supported` must hold)."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    order, offs = sort_pairs(topk_ids, gate_up_proj.shape[0])
    rows = x.index_select(0, order // top_k)
    act = silu_and_mul(_GROUPED_MM(rows, gate_up_proj.transpose(1, 2), offs=offs))
    down = _GROUPED_MM(act, down_proj.transpose(1, 2), offs=offs)
    per_pair = torch.empty(num_tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    if per_pair.numel():
        weights = topk_weights.reshape(-1)
        _unpermute_kernel[(per_pair.shape[0], triton.cdiv(hidden, _BLOCK_H))](
            down, order, weights if weights.is_contiguous() else weights.contiguous(), per_pair, hidden,
            BLOCK_H=_BLOCK_H, num_warps=4)
    return per_pair
