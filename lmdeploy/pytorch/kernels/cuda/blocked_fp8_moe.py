"""Triton fused MoE with block-wise FP8 experts (W8A8); semantics of `kernels/default/blocked_fp8.
fused_moe_blocked_fp8`, structure of `kernels/cuda/moe.py` (same pair alignment, no host sync):

1. x is quantized per token and group of bk channels (`quant_fp8`).
2. Up GEMM: per (row block, column block of I), gate and up tiles of the expert's FP8 `gate_up_proj`, each K step
   scaled by the tokens' activation scales and the columns' weight-block scales; `silu(gate) * up` stored in x's dtype
   in sorted-row order.
3. That intermediate is quantized per row group, then the down GEMM (scaled the same way) times the routing weight
   writes one row per (token, expert) pair; the top_k rows of each token are summed.

BLOCK_K equals the weight block's bk, so each K step reads one scale per operand row.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import moe
from .blocked_fp8 import quant_fp8
from .launch import fast_kernel, wait_for_inputs
from .moe import align_expert_pairs, moe_block, row_block, store_routed, store_swiglu


@fast_kernel
@triton.jit
def _moe_up_fp8_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr, num_pairs, hidden,
                       inter, stride_xt, stride_xst, stride_we, stride_wn, stride_wse, stride_wsn, stride_ot,
                       TOP_K: tl.constexpr, NUM_EXPERTS: tl.constexpr, BLOCK_SIZE_N: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       COLS_FIRST: tl.constexpr = False, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    expert, rows, pairs, row_mask, cols, col_mask = moe_block(sorted_pairs_ptr, block_expert_ptr, num_pairs, inter,
                                                              BLOCK_M, BLOCK_N, COLS_FIRST)
    if expert >= NUM_EXPERTS:
        return
    tokens = (pairs // TOP_K).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :]
    w_base = w_ptr + expert * stride_we + offs_k[:, None]
    gate_ptrs = w_base + cols.to(tl.int64)[None, :] * stride_wn
    up_ptrs = w_base + (cols + inter).to(tl.int64)[None, :] * stride_wn
    xs_ptrs = xs_ptr + tokens * stride_xst
    gate_s_ptrs = ws_ptr + expert * stride_wse + (cols // BLOCK_SIZE_N) * stride_wsn
    up_s_ptrs = ws_ptr + expert * stride_wse + ((cols + inter) // BLOCK_SIZE_N) * stride_wsn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(hidden, BLOCK_K)):
        k_mask = offs_k < hidden - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b_mask = k_mask[:, None] & col_mask[None, :]
        gate_w = tl.load(gate_ptrs, mask=b_mask, other=0.0)
        up_w = tl.load(up_ptrs, mask=b_mask, other=0.0)
        a_s = tl.load(xs_ptrs + kb, mask=row_mask, other=0.0)
        gate_s = tl.load(gate_s_ptrs + kb, mask=col_mask, other=0.0)
        up_s = tl.load(up_s_ptrs + kb, mask=col_mask, other=0.0)
        acc_gate += tl.dot(a, gate_w) * a_s[:, None] * gate_s[None, :]
        acc_up += tl.dot(a, up_w) * a_s[:, None] * up_s[None, :]
        a_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    store_swiglu(acc_gate, acc_up, out_ptr, rows, cols, row_mask, col_mask, stride_ot)


@fast_kernel
@triton.jit
def _moe_down_fp8_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, weights_ptr, sorted_pairs_ptr, block_expert_ptr,
                         num_pairs, hidden, inter, stride_at, stride_ast, stride_we, stride_wn, stride_wse,
                         stride_wsn, stride_ot, NUM_EXPERTS: tl.constexpr, BLOCK_SIZE_N: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         COLS_FIRST: tl.constexpr = False, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    expert, rows, pairs, row_mask, cols, col_mask = moe_block(sorted_pairs_ptr, block_expert_ptr, num_pairs, hidden,
                                                              BLOCK_M, BLOCK_N, COLS_FIRST)
    if expert >= NUM_EXPERTS:
        return
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_at + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + cols.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    as_ptrs = as_ptr + rows.to(tl.int64) * stride_ast
    ws_ptrs = ws_ptr + expert * stride_wse + (cols // BLOCK_SIZE_N) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(inter, BLOCK_K)):
        k_mask = offs_k < inter - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        a_s = tl.load(as_ptrs + kb, mask=row_mask, other=0.0)
        w_s = tl.load(ws_ptrs + kb, mask=col_mask, other=0.0)
        acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    store_routed(acc, out_ptr, weights_ptr, pairs, cols, row_mask, col_mask, stride_ot)


class Fp8MoeConfig(NamedTuple):
    """Tiles of one FP8 MoE call: BLOCK_M (also the alignment's padding) and, per GEMM, (BLOCK_N, num_warps,
    num_stages); BLOCK_K is the weights' block width."""
    block_m: int
    up: tuple[int, int, int]
    down: tuple[int, int, int]


# From this many rows an expert (the column-first order's threshold, `moe.COLS_FIRST_ROWS`) the up launch takes 4
# stages and the down launch 128 columns: the best of `bench_fp8_moe.py`'s sweep at both released expert counts on
# the H100 (8,192 tokens: 256 experts top-8, 256 rows an expert, 1,697.7 -> 1,640.0 us; 512 experts top-10, 160 rows,
# 2,307.2 -> 2,183.9 us: about the bench's noise, but both sweeps chose these tiles; docs/benchmarks.md, "H100 runs
# 84-85"). Not `moe.LARGE_ROWS`, the bf16 experts' threshold for their large untuned tiles.
FP8_LARGE_ROWS = 128


def default_fp8_config(num_pairs: int, num_experts: int) -> Fp8MoeConfig:
    """The tiles every FP8 MoE call takes unless given others (`benchmark/bench_fp8_moe.py` sweeps them): the bf16
    experts' untuned row block (`moe.row_block`), 64 columns, 4 warps, 3 stages; from `FP8_LARGE_ROWS` rows an expert
    the up launch's 4 stages and the down launch's 128 columns."""
    block_m = row_block(num_pairs, num_experts)
    if num_pairs >= FP8_LARGE_ROWS * num_experts:
        return Fp8MoeConfig(block_m, (64, 4, 4), (128, 4, 3))
    return Fp8MoeConfig(block_m, (64, 4, 3), (64, 4, 3))


def fused_moe_blocked_fp8(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                          topk_weights: torch.Tensor, topk_ids: torch.Tensor, gate_up_scale: torch.Tensor,
                          down_scale: torch.Tensor, block_size: tuple[int, int],
                          config: Fp8MoeConfig | None = None) -> torch.Tensor:
    """x [T, H] bf16 / fp16; gate_up_proj [E, 2I, H] / down_proj [E, H, I] FP8 with scales [E, ceil(2I / bn),
    ceil(H / bk)] / [E, ceil(H / bn), ceil(I / bk)]; I a multiple of bn. Returns [T, H] in x's dtype. `config`
    overrides `default_fp8_config`'s tiles (benchmarks)."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, double_inter, _ = gate_up_proj.shape
    inter = double_inter // 2
    block_n, block_k = block_size
    assert gate_up_proj.shape == (num_experts, 2 * inter, hidden) and down_proj.shape == (num_experts, hidden, inter)
    assert inter % block_n == 0, f'intermediate size {inter} is not a multiple of the block rows {block_n}'
    assert gate_up_scale.shape == (num_experts, 2 * inter // block_n, triton.cdiv(hidden, block_k))
    assert down_scale.shape == (num_experts, triton.cdiv(hidden, block_n), triton.cdiv(inter, block_k))
    assert gate_up_proj.stride(-1) == 1 and down_proj.stride(-1) == 1
    if num_tokens == 0 or top_k == 0:
        return torch.zeros_like(x)
    xq, x_scale = quant_fp8(x if x.stride(-1) == 1 else x.contiguous(), block_k)
    num_pairs = num_tokens * top_k
    block_m, up, down = config or default_fp8_config(num_pairs, num_experts)
    sorted_pairs, block_expert = align_expert_pairs(topk_ids, num_experts, block_m)
    num_blocks = block_expert.shape[0]
    order = moe.cols_first(num_pairs, num_experts, block_m)

    act = torch.empty(sorted_pairs.shape[0], inter, dtype=x.dtype, device=x.device)
    tile_n, warps, stages = up
    _moe_up_fp8_kernel[moe.expert_grid(num_blocks, triton.cdiv(inter, tile_n), order)](
        xq, x_scale, gate_up_proj, gate_up_scale, act, sorted_pairs, block_expert, num_pairs=num_pairs,
        hidden=hidden, inter=inter, stride_xt=xq.stride(0), stride_xst=x_scale.stride(0),
        stride_we=gate_up_proj.stride(0), stride_wn=gate_up_proj.stride(1), stride_wse=gate_up_scale.stride(0),
        stride_wsn=gate_up_scale.stride(1), stride_ot=act.stride(0), TOP_K=top_k, NUM_EXPERTS=num_experts,
        BLOCK_SIZE_N=block_n, BLOCK_M=block_m, BLOCK_N=tile_n, BLOCK_K=block_k, COLS_FIRST=order,
        num_warps=warps, num_stages=stages)

    act_q, act_scale = quant_fp8(act, block_k)
    per_pair = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()
    tile_n, warps, stages = down
    _moe_down_fp8_kernel[moe.expert_grid(num_blocks, triton.cdiv(hidden, tile_n), order)](
        act_q, act_scale, down_proj, down_scale, per_pair, weights, sorted_pairs, block_expert, num_pairs=num_pairs,
        hidden=hidden, inter=inter, stride_at=act_q.stride(0), stride_ast=act_scale.stride(0),
        stride_we=down_proj.stride(0), stride_wn=down_proj.stride(1), stride_wse=down_scale.stride(0),
        stride_wsn=down_scale.stride(1), stride_ot=per_pair.stride(0), NUM_EXPERTS=num_experts,
        BLOCK_SIZE_N=block_n, BLOCK_M=block_m, BLOCK_N=tile_n, BLOCK_K=block_k, COLS_FIRST=order,
        num_warps=warps, num_stages=stages)
    return per_pair.view(num_tokens, top_k, hidden).sum(dim=1)


def warm_up_token_counts(num_experts: int, top_k: int, max_tokens: int) -> list[int]:
    """Token counts in 1..`max_tokens` whose calls reach every (tiles, class of the pair count, alignment launch,
    program order) that any count there reaches (every other argument is fixed by the shape): the first count of
    each."""
    def key(tokens: int) -> tuple:
        config = default_fp8_config(tokens * top_k, num_experts)
        return config, *moe.pair_count_key(tokens * top_k, num_experts, config.block_m)
    return moe.first_counts(max_tokens, key)


def warm_up_tiles(gate_up_proj: torch.Tensor, down_proj: torch.Tensor, gate_up_scale: torch.Tensor,
                  down_scale: torch.Tensor, block_size: tuple[int, int], top_k: int, max_tokens: int,
                  dtype: torch.dtype) -> int:
    """Compile every binary `fused_moe_blocked_fp8` can pick for these experts in forwards of 1..`max_tokens` tokens
    (`warm_up_token_counts`) on zero activations of `dtype`, as `moe.warm_up_tiles` does for bf16 experts (the eager
    warm-up's token counts alone miss some, e.g. BLOCK_M 32 in the two-launch alignment). Returns the number of
    calls."""
    num_experts, _, hidden = gate_up_proj.shape
    device = gate_up_proj.device
    counts = warm_up_token_counts(num_experts, top_k, max_tokens)
    for tokens in counts:
        x, weights, ids = moe.warm_up_inputs(tokens, hidden, top_k, num_experts, dtype, device)
        fused_moe_blocked_fp8(x, gate_up_proj, down_proj, weights, ids, gate_up_scale, down_scale, block_size)
    return len(counts)
