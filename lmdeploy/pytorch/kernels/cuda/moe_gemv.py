"""Fused MoE for a few tokens (decode), in two launches that stream each routed expert's weights like `gemv.py`.

`moe.fused_moe` groups the (token, expert) pairs by expert (three alignment launches), multiplies row blocks of
at least 16 rows with `tl.dot` (a decode token's pair fills one of them), writes one output row per pair and sums
a token's `top_k` rows in torch: six launches a MoE layer, each of a few microseconds at batch 1, where the H200
profile of the 35B-A3B shape's decode step counts ~27 kernels a layer (`docs/benchmarks.md`, run 12). Here:

1. Up: program (pair, column block of I) reads the pair's expert id, streams `BLOCK_N` gate rows and the matching
   up rows of that expert's `gate_up_proj` against the token's row (fp32 `[BLOCK_N, BLOCK_K]` accumulators
   reduced once) and stores `silu(gate) * up` for the pair.
2. Down: program (token, column block of H) loops over the token's `top_k` pairs, streams `BLOCK_N` rows of each
   expert's `down_proj` against the pair's intermediate and adds it times the routing weight: the token's output
   row, with no per-pair buffer and no sum launch (deterministic: a fixed order over k).

Same semantics as `fused_moe` (`backends/default/moe.py`): the gate and up projections and each pair's down
projection are rounded to `x.dtype`, the routing weight is applied in that dtype; the sum over k is accumulated in
fp32 and rounded once (`fused_moe` rounds each weighted pair first). A shared expert runs as expert id E, as there.

No argument or tile depends on the token count (the grid does), so one binary per expert shape serves every batch
and the start-up warm-up's first call (`moe.warm_up_tiles`, one token) compiles it. `fused_moe` takes this path for
up to `MAX_TOKENS` tokens by default (`LMDEPLOY_MOE_GEMV=0` keeps its own launches; `benchmark/bench_moe_kernel.py
--gemv` times both: on the H200 one token 20.5 us a 35B-A3B layer against 32.0, four 49.2 against 58.0).

The down launch reaches half the copy rate where the up launch reaches 0.83 (H100 run 72). Its reduction unrolled
as well (every load of a program one straight-line block) measured the same (H100 run 74: 23.3 against 22.9 us a
layer for one token at top-8, 27.8 against 28.7 at top-10), so the loop stays: the launch moves ~19 MB, a few
microseconds at the copy rate, and its fixed start-up is what halves the rate.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .gemv import gemv_config
from .launch import device_sm_count, fast_kernel, wait_for_inputs

MAX_TOKENS = 4  # fused_moe's dispatch bound: pairs of a few tokens rarely share an expert, so each streams its own


@triton.jit
def expert_weights(w_ptr, shared_ptr, expert, stride_we, NUM_EXPERTS: tl.constexpr, HAS_SHARED: tl.constexpr):
    """The first weight of `expert`: row `expert` of the routed experts' stack, or with HAS_SHARED the shared
    expert's own tensor for id NUM_EXPERTS (same row / column strides as one routed expert)."""
    start = w_ptr + expert * stride_we
    if HAS_SHARED:   # a select, not a branch: the down launch's unrolled top-k loop stays one block
        start = tl.where(expert == NUM_EXPERTS, shared_ptr, start)
    return start


@fast_kernel
@triton.jit
def _moe_gemv_up_kernel(x_ptr, w_ptr, shared_ptr, ids_ptr, act_ptr, hidden, inter, stride_xt, stride_we, stride_wn,
                        stride_at, TOP_K: tl.constexpr, NUM_EXPERTS: tl.constexpr, HAS_SHARED: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    pair = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < inter
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    token = (pair // TOP_K).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    w_base = expert_weights(w_ptr, shared_ptr, expert, stride_we, NUM_EXPERTS, HAS_SHARED)
    gate_ptrs = w_base + cols.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    up_ptrs = gate_ptrs + inter * stride_wn
    x_ptrs = x_ptr + token * stride_xt + offs_k
    acc_gate = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_mask = offs_k < hidden - k0
        w_mask = col_mask[:, None] & k_mask[None, :]
        x = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        acc_gate += tl.load(gate_ptrs, mask=w_mask, other=0.0).to(tl.float32) * x
        acc_up += tl.load(up_ptrs, mask=w_mask, other=0.0).to(tl.float32) * x
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    dtype = act_ptr.dtype.element_ty
    gate = tl.sum(acc_gate, 1).to(dtype).to(tl.float32)
    up = tl.sum(acc_up, 1).to(dtype).to(tl.float32)
    tl.store(act_ptr + pair.to(tl.int64) * stride_at + cols, (gate * tl.sigmoid(gate) * up).to(dtype), mask=col_mask)


@fast_kernel
@triton.jit
def _moe_gemv_down_kernel(act_ptr, w_ptr, shared_ptr, ids_ptr, weights_ptr, out_ptr, hidden, inter, stride_at,
                          stride_we, stride_wn, stride_ot, TOP_K: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                          HAS_SHARED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          UNROLL: tl.constexpr, PDL: tl.constexpr = False):
    """Program (token, column block): the token's top-k pairs through their experts' rows."""
    wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < hidden
    offs_k = tl.arange(0, BLOCK_K)
    dtype = out_ptr.dtype.element_ty
    out = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.range(TOP_K, loop_unroll_factor=UNROLL):   # unrolled: the experts' loads issue together
        pair = token * TOP_K + j
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        route = tl.load(weights_ptr + pair).to(dtype).to(tl.float32)
        w_ptrs = (expert_weights(w_ptr, shared_ptr, expert, stride_we, NUM_EXPERTS, HAS_SHARED)
                  + cols.to(tl.int64)[:, None] * stride_wn + offs_k[None, :])
        a_ptrs = act_ptr + pair * stride_at + offs_k
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k_mask = offs_k < inter - k0
            a = tl.load(a_ptrs, mask=k_mask, other=0.0).to(tl.float32)[None, :]
            acc += tl.load(w_ptrs, mask=col_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32) * a
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        out += tl.sum(acc, 1).to(dtype).to(tl.float32) * route
    tl.store(out_ptr + token * stride_ot + cols, out.to(dtype), mask=col_mask)


def default_tiles(top_k: int, hidden: int, inter: int, sms: int) -> dict:
    """Both launches' tiles (`fused_moe_gemv`'s `config`): `up` / `down` dicts of BLOCK_N, BLOCK_K, num_warps and
    the down launch's UNROLL of its top-k loop, from one token's shape so they do not move with the count. The H200
    sweep (`bench_moe_kernel.py --gemv-sweep`, 35B-A3B experts, top-8, one and two tokens) found: up as
    `gemv.gemv_config` tiles the pairs' stacked gate rows (there one row a program, 512-column steps, 4 warps);
    down 8 rows a program, 128-column steps on 8 warps, the top-k loop unrolled so the experts' loads issue
    together (20.6 us a layer for one token against 23.1 for the old two-programs-an-SM rule, 32.0 for `fused_moe`)."""
    block_k = min(128, max(16, triton.next_power_of_2(inter)))
    return dict(up=gemv_config(top_k * inter, hidden, sms),
                down=dict(BLOCK_N=8, BLOCK_K=block_k, num_warps=8, UNROLL=top_k))


@functools.lru_cache(maxsize=64)
def _launch_tiles(top_k: int, hidden: int, inter: int, sms: int) -> tuple[dict, dict]:
    """`default_tiles(...)`'s two launches once per shape: a decode step's MoE layers look them up, not rebuild them."""
    tiles = default_tiles(top_k, hidden, inter, sms)
    return tiles['up'], tiles['down']


def fused_moe_gemv(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor] | None = None,
                   config: dict | None = None) -> torch.Tensor:
    """`moe.fused_moe`'s contract (x [T, H], gate_up_proj [E, 2I, H], down_proj [E, H, I], topk_* [T, K], `shared`
    as expert id E), for few tokens: weights contiguous in their last dim, x rows contiguous. `config`:
    `default_tiles`' form, for benchmarks."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, double_inter, _ = gate_up_proj.shape
    inter = double_inter // 2
    out = torch.empty_like(x)
    if num_tokens == 0 or top_k == 0:
        return out.zero_()
    assert x.stride(-1) == 1 and gate_up_proj.stride(-1) == 1 and down_proj.stride(-1) == 1
    shared_gate_up, shared_down = shared if shared is not None else (gate_up_proj, down_proj)
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).contiguous()
    num_pairs = num_tokens * top_k
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    if config is None:
        up, down = _launch_tiles(top_k, hidden, inter, device_sm_count(x.device))
    else:
        up, down = config['up'], config['down']
    _moe_gemv_up_kernel[(num_pairs, triton.cdiv(inter, up['BLOCK_N']))](
        x, gate_up_proj, shared_gate_up, ids, act, hidden, inter, x.stride(0), gate_up_proj.stride(0),
        gate_up_proj.stride(1), act.stride(0), TOP_K=top_k, NUM_EXPERTS=num_experts, HAS_SHARED=int(shared is not None),
        **up)
    _moe_gemv_down_kernel[(num_tokens, triton.cdiv(hidden, down['BLOCK_N']))](
        act, down_proj, shared_down, ids, weights, out, hidden, inter, act.stride(0), down_proj.stride(0),
        down_proj.stride(1), out.stride(0), TOP_K=top_k, NUM_EXPERTS=num_experts, HAS_SHARED=int(shared is not None),
        **down)
    return out
