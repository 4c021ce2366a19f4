"""Triton fused MoE (SwiGLU experts); semantics of `backends/default/moe.py`.

Algorithm (no host sync; every size comes from host-side shapes):

1. Align: the ``N = T * top_k`` (token, expert) pairs are grouped by expert and each expert's run is padded to a
   multiple of ``BLOCK_M``, giving ``sorted_pairs`` (pair index, or the sentinel ``N`` in padding) and one expert
   id per block of ``BLOCK_M`` rows (``E`` for blocks past the end, whose programs exit at once). At most
   ``cdiv(N, BLOCK_M) + min(E, N)`` blocks are ever needed, so buffers are sized by that bound.
2. Up GEMM: program (row block, column block of I) computes the gate and up tiles of its expert's
   ``gate_up_proj`` for the block's token rows and stores ``silu(gate) * up`` in sorted-row order.
3. Down GEMM: program (row block, column block of H) multiplies by ``down_proj[e]``, scales by the pair's routing
   weight and stores row ``pair`` of a ``[T * top_k, H]`` buffer (each pair written by exactly one program).
4. The ``top_k`` rows of each token are summed (deterministic: no atomics); a shared expert's gated output the
   block passes is added after (opt-in: in the same launch, `combine_pairs`).

Accumulation is float32; the intermediate and per-pair outputs are rounded to ``x.dtype``.
"""
from __future__ import annotations

import functools
import json
import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..default.expert_groups import add_gated_shared
from . import moe_gemv
from .launch import arg_key, fast_kernel, wait_for_inputs
from .moe_align import align_launch_key, align_mode, align_pairs, align_pairs_reference, block_bound
from .moe_gemv import expert_weights

# The alignment: Triton, one launch for up to 2048 pairs and two above (default, `LMDEPLOY_MOE_ALIGN=one`; three above
# with `=three`), three for every count (`=triton`), or `moe_align.py`'s ~20 torch ops (`=torch`).
_TRITON_ALIGN = align_mode() != 'torch'
# Forwards of up to `moe_gemv.MAX_TOKENS` tokens take `moe_gemv.py`'s two launches (default since H200 runs 40-41: the
# 35B-A3B shape's batch-1 decode from 0.35 to 0.45 of the weight roofline); LMDEPLOY_MOE_GEMV=0 keeps this module's
# launches.
_MOE_GEMV = os.environ.get('LMDEPLOY_MOE_GEMV', '1') != '0'
# A shared expert's gated output added in the launch that sums the routed pairs (`combine_pairs`), on by default
# since H100 runs 58-63 (its gpu tests and the MoE engine tests pass; with the state-row copies and packed GQA
# below, the 80B suffix rows 0.6-0.8 ms faster); LMDEPLOY_MOE_COMBINE=0: the top-k sum and the torch add.
_COMBINE = os.environ.get('LMDEPLOY_MOE_COMBINE', '1') != '0'
# The expert GEMMs' program order: from `COLS_FIRST_ROWS` rows an expert (prefills) a row block's column tiles are
# launched together (grid (column tiles, row blocks)) instead of one column tile of every row block, so that a long
# prefill's rows (read once per column tile) and its experts' weight tiles are shared through L2 by programs that run
# at the same time, where the row-first order rereads every row block once per column tile from memory. H100 runs
# 81-83: the down launch of a cold 8K prompt of the 35B-A3B 20.1 -> 13.4 ms over 40 layers (the prompt 127.5 ->
# 120.4 ms), the kernel 1,229 -> 1,054 us at 8,192 tokens, 653 -> 554 at 4,096, 221 -> 214 at 1,024 (128 rows an
# expert, the least measured); 8K tokens of 256 / 512 experts 18-31% faster in bf16, 11-13% in FP8.
# LMDEPLOY_MOE_COLS_FIRST=1: column tiles first at every count, =0: never. `blocked_fp8_moe.py` follows it too.
COLS_FIRST_ROWS = 128
_COLS_FIRST_MODE = os.environ.get('LMDEPLOY_MOE_COLS_FIRST', 'auto')
if _COLS_FIRST_MODE not in ('auto', '0', '1'):
    raise ValueError(f'LMDEPLOY_MOE_COLS_FIRST={_COLS_FIRST_MODE!r}: expected 0, 1 or auto')
# Tuned tile tables (`benchmark/bench_moe_kernel.py --write-config`): this package's `moe_configs/`, or the
# folder LMDEPLOY_MOE_CONFIG_DIR names (searched first).
_CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'moe_configs')


@triton.jit
def moe_block(sorted_pairs_ptr, block_expert_ptr, num_pairs, num_cols, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, COLS_FIRST: tl.constexpr = False):
    """The program's row block (its expert; each row's pair, or the sentinel `num_pairs` in padding) and column
    tile: grid (row blocks, column tiles), or with COLS_FIRST (column tiles, row blocks), so that the programs
    launched together are a row block's column tiles (`cols_first`). A block past the end has
    expert E: the caller exits on it (the loads stay inside the padded buffers)."""
    block = tl.program_id(1) if COLS_FIRST else tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    cols = (tl.program_id(0) if COLS_FIRST else tl.program_id(1)) * BLOCK_N + tl.arange(0, BLOCK_N)
    return expert, rows, pairs, pairs < num_pairs, cols, cols < num_cols


@triton.jit
def store_swiglu(acc_gate, acc_up, out_ptr, rows, cols, row_mask, col_mask, stride_ot):
    """`silu(gate) * up` into rows `rows` (sorted order) of the intermediate, with the gate and up projections
    rounded to the activation dtype first, like the reference (each accumulator through a float32 add first, as in
    `store_routed`: for fp16 at BLOCK_M 128 x BLOCK_N 128 the rounding serialized the K loop's wgmma too)."""
    gate = (acc_gate + 0.0).to(out_ptr.dtype.element_ty).to(tl.float32)
    up = (acc_up + 0.0).to(out_ptr.dtype.element_ty).to(tl.float32)
    act = gate * tl.sigmoid(gate) * up
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_ot + cols[None, :]
    tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def store_routed(acc, out_ptr, weights_ptr, pairs, cols, row_mask, col_mask, stride_ot):
    """Row `pair` of the per-pair output: the down projection (rounded to the output dtype) times the pair's
    routing weight (in that dtype), like the reference.

    The accumulator goes through one float32 add before its rounding (the same values, a zero's sign aside): read
    directly by the scalar bf16 conversions the compiler emits for this rounding, a wgmma accumulator makes ptxas
    serialize every wgmma of the K loop (its warning C7514: the down launch at BLOCK_M 64 / 128, the row blocks of
    prefills from ~1K tokens); `tests/kernels/test_kernel_ptx.py` checks the sm90 build for it."""
    route = tl.load(weights_ptr + pairs, mask=row_mask, other=0.0).to(out_ptr.dtype.element_ty).to(tl.float32)
    y = (acc + 0.0).to(out_ptr.dtype.element_ty).to(tl.float32) * route[:, None]
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_ot + cols[None, :]
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@fast_kernel
@triton.jit
def _moe_up_kernel(x_ptr, w_ptr, shared_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr, num_pairs, hidden, inter,
                   stride_xt, stride_we, stride_wn, stride_wk, stride_ot, TOP_K: tl.constexpr,
                   NUM_EXPERTS: tl.constexpr, HAS_SHARED: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   COLS_FIRST: tl.constexpr = False, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    expert, rows, pairs, row_mask, cols, col_mask = moe_block(sorted_pairs_ptr, block_expert_ptr, num_pairs, inter,
                                                              BLOCK_M, BLOCK_N, COLS_FIRST)
    if expert >= NUM_EXPERTS + HAS_SHARED:
        return
    tokens = (pairs // TOP_K).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :]
    w_base = expert_weights(w_ptr, shared_ptr, expert, stride_we, NUM_EXPERTS, HAS_SHARED) + offs_k[:, None] * stride_wk
    gate_ptrs = w_base + cols[None, :] * stride_wn
    up_ptrs = w_base + (cols + inter)[None, :] * stride_wn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_mask = offs_k < hidden - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b_mask = k_mask[:, None] & col_mask[None, :]
        gate_w = tl.load(gate_ptrs, mask=b_mask, other=0.0)
        up_w = tl.load(up_ptrs, mask=b_mask, other=0.0)
        a = a.to(gate_w.dtype)
        acc_gate = tl.dot(a, gate_w, acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(a, up_w, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K * stride_wk
        up_ptrs += BLOCK_K * stride_wk
    store_swiglu(acc_gate, acc_up, out_ptr, rows, cols, row_mask, col_mask, stride_ot)


@fast_kernel
@triton.jit
def _moe_down_kernel(a_ptr, w_ptr, shared_ptr, out_ptr, weights_ptr, sorted_pairs_ptr, block_expert_ptr, num_pairs,
                     hidden, inter, stride_at, stride_we, stride_wn, stride_wk, stride_ot, NUM_EXPERTS: tl.constexpr,
                     HAS_SHARED: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COLS_FIRST: tl.constexpr = False,
                     PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    expert, rows, pairs, row_mask, cols, col_mask = moe_block(sorted_pairs_ptr, block_expert_ptr, num_pairs, hidden,
                                                              BLOCK_M, BLOCK_N, COLS_FIRST)
    if expert >= NUM_EXPERTS + HAS_SHARED:
        return
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_at + offs_k[None, :]
    w_ptrs = (expert_weights(w_ptr, shared_ptr, expert, stride_we, NUM_EXPERTS, HAS_SHARED) + cols[None, :] * stride_wn
              + offs_k[:, None] * stride_wk)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_mask = offs_k < inter - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(a.to(w.dtype), w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    store_routed(acc, out_ptr, weights_ptr, pairs, cols, row_mask, col_mask, stride_ot)


@fast_kernel
@triton.jit(do_not_specialize=['stride_lt'])
def _combine_kernel(pairs_ptr, shared_ptr, logit_ptr, out_ptr, hidden, stride_st, stride_lt, TOP_K: tl.constexpr,
                    BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
    """Program (token, column block): the token's TOP_K weighted rows summed, plus sigmoid(logit) * shared (float32,
    one rounding)."""
    wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(pairs_ptr + (token * TOP_K + k) * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.sigmoid(tl.load(logit_ptr + token * stride_lt).to(tl.float32))
    acc += gate * tl.load(shared_ptr + token * stride_st + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def combine_pairs(per_pair: torch.Tensor, top_k: int, gated_shared: tuple[torch.Tensor, torch.Tensor]
                  ) -> torch.Tensor:
    """[T, H]: the sum of each token's `top_k` rows of `per_pair` [T * top_k, H] (contiguous) plus
    ``sigmoid(logit) * shared`` for `gated_shared` = (shared [T, H], logit [T, 1]), in one launch."""
    num_pairs, hidden = per_pair.shape
    num_tokens = num_pairs // top_k
    shared, logit = gated_shared
    assert shared.shape == (num_tokens, hidden) and shared.stride(-1) == 1, f'bad shared {tuple(shared.shape)}'
    assert logit.shape == (num_tokens, 1), f'bad shared logit {tuple(logit.shape)}'
    out = torch.empty(num_tokens, hidden, dtype=per_pair.dtype, device=per_pair.device)
    if num_tokens == 0:
        return out
    block_h = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        per_pair, shared, logit, out, hidden, shared.stride(0), logit.stride(0), TOP_K=top_k, BLOCK_H=block_h,
        num_warps=4)
    return out


def few_token_path_enabled() -> bool:
    """Whether `fused_moe` takes `moe_gemv.py` for forwards of up to `moe_gemv.MAX_TOKENS` tokens."""
    return _MOE_GEMV


def align_expert_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [max_blocks * BLOCK_M], block_expert [max_blocks]) as described in the module docstring:
    `moe_align.py`'s Triton form (one launch, two or three), or its torch form with `LMDEPLOY_MOE_ALIGN=torch`."""
    if not _TRITON_ALIGN:
        return align_pairs_reference(topk_ids, num_experts, block_m)
    return align_pairs(topk_ids, num_experts, block_m)


class MoeConfig(NamedTuple):
    """Tile sizes and launch options of one fused MoE call: BLOCK_M (rows of one expert per program; also the
    alignment's padding) and, per GEMM, (BLOCK_N, BLOCK_K, num_warps, num_stages)."""
    block_m: int
    up: tuple[int, int, int, int]
    down: tuple[int, int, int, int]


def row_block(num_pairs: int, num_experts: int) -> int:
    """BLOCK_M when no table applies: small row blocks when experts see few rows (decode), larger for prefill."""
    rows_per_expert = num_pairs / num_experts
    return 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 64 else 64


def config_file_name(num_experts: int, hidden: int, inter: int, device_name: str) -> str:
    """`E=64,H=2048,I=512,device=NVIDIA_H200.json`: one table per expert shape and device."""
    return f'E={num_experts},H={hidden},I={inter},device={device_name.replace(" ", "_")}.json'


@functools.cache
def _table(num_experts: int, hidden: int, inter: int, device_name: str) -> tuple[tuple[int, MoeConfig], ...]:
    """The tuned table for this shape and device, sorted by its (token, expert) pair counts; () if none."""
    name = config_file_name(num_experts, hidden, inter, device_name)
    for folder in (os.environ.get('LMDEPLOY_MOE_CONFIG_DIR'), _CONFIG_DIR):
        path = os.path.join(folder, name) if folder else None
        if path and os.path.isfile(path):
            try:
                with open(path) as f:
                    raw = json.load(f)
                return tuple(sorted((int(pairs), MoeConfig(int(bm), tuple(map(int, up)), tuple(map(int, down))))
                                    for pairs, (bm, up, down) in raw['configs'].items()))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ValueError(f'bad MoE tile table {path}: {exc!r}') from exc
    return ()


def table_pair_counts(num_experts: int, hidden: int, inter: int, device_name: str | None) -> list[int]:
    """The (token, expert) pair counts of this shape's table entries (for the start-up warm-up)."""
    return [pairs for pairs, _ in _table(num_experts, hidden, inter, device_name)] if device_name else []


@functools.cache
def cuda_device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def _device_name(device: torch.device) -> str | None:
    """The CUDA device's name (the tables' key), None off CUDA."""
    if device.type != 'cuda':
        return None
    return cuda_device_name(torch.cuda.current_device() if device.index is None else device.index)


# Tiles without a table for prefills of at least LARGE_ROWS rows an expert: what both tuned tables chose there
# (H100 runs 65 / 80 and H200 run 11, 64 x (H 2048, I 512): 512 and 1,024 rows an expert), where the untuned tiles
# below were 1.14-1.39x slower. A released checkpoint's expert count (256, 512) has no table of its own.
LARGE_ROWS = 256
LARGE_ROWS_CONFIG = MoeConfig(128, (128, 64, 8, 4), (128, 64, 8, 3))


def default_config(num_pairs: int, num_experts: int, hidden: int = 0, inter: int = 0,
                   device_name: str | None = None, half: bool = True) -> MoeConfig:
    """The tuned entry nearest to `num_pairs` (by ratio) of this expert shape's table for `device_name` (a CUDA
    device's name), else the untuned tiles: `LARGE_ROWS_CONFIG` from `LARGE_ROWS` rows an expert, below it
    (`row_block`, 64 x 64, 4 warps, 3 stages). `half=False` (float32 experts) takes the latter always: the tables
    and the large tiles are half-precision ones, and in float32 their pipelined operands outgrow shared memory
    (the up launch at 128 rows x 128 columns, 4 stages: 288 KiB)."""
    table = _table(num_experts, hidden, inter, device_name) if device_name and half else ()
    if table:
        return min(table, key=lambda entry: abs(math.log(entry[0] / max(num_pairs, 1))))[1]
    if half and num_pairs >= LARGE_ROWS * num_experts:
        return LARGE_ROWS_CONFIG
    return MoeConfig(row_block(num_pairs, num_experts), (64, 64, 4, 3), (64, 64, 4, 3))


# `default_config` per (pairs, shape, device): the eager forward's MoE layers look it up once each, not per call.
_call_config = functools.lru_cache(maxsize=4096)(default_config)


# the most programs a CUDA grid's second dimension holds (the column-first order's row blocks)
MAX_GRID_Y = 65535


def cols_first(num_pairs: int, num_experts: int, block_m: int) -> bool:
    """Whether the expert GEMMs of a call with `num_pairs` (token, expert) pairs over `num_experts` routed experts
    at BLOCK_M `block_m` launch a row block's column tiles together (`COLS_FIRST_ROWS`, LMDEPLOY_MOE_COLS_FIRST);
    never where its row blocks (with one more for a shared expert run as an expert) could outnumber a grid's second
    dimension (`MAX_GRID_Y`: more than a million pairs at BLOCK_M 16)."""
    if block_bound(num_pairs, num_experts + 1, block_m) > MAX_GRID_Y or _COLS_FIRST_MODE == '0':
        return False
    return _COLS_FIRST_MODE == '1' or num_pairs >= COLS_FIRST_ROWS * num_experts


def expert_grid(num_blocks: int, num_tiles: int, columns_first: bool) -> tuple[int, int]:
    """The expert GEMMs' grid, (row blocks, column tiles) or with `columns_first` (column tiles, row blocks)."""
    if columns_first:
        assert num_blocks <= MAX_GRID_Y, f'{num_blocks} row blocks: more than a grid dimension holds'
        return num_tiles, num_blocks
    return num_blocks, num_tiles


def fused_moe(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: MoeConfig | None = None,
              shared: tuple[torch.Tensor, torch.Tensor] | None = None,
              gated_shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) with SwiGLU experts.

    x [T, H]; gate_up_proj [E, 2I, H] (gate rows first, then up); down_proj [E, H, I]; topk_weights [T, K] (any
    float dtype, applied in x's dtype); topk_ids [T, K] int64. Returns [T, H] in x's dtype. `config` overrides
    the tile sizes `default_config` picks (`benchmark/bench_moe_kernel.py` sweeps them); without one, and unless
    `LMDEPLOY_MOE_GEMV=0`, forwards of up to `moe_gemv.MAX_TOKENS` tokens run `moe_gemv.fused_moe_gemv`. `shared`
    (gate_up [2I, H], down [H, I], the strides of one routed expert): a shared expert run as expert id E in the
    same launches; the last column of `topk_ids` is then E for every token and that of `topk_weights` its scale (the
    sigmoid gate). `gated_shared` (shared [T, H], logit [T, 1]): a shared expert's output computed apart, added as
    ``sigmoid(logit) * shared`` (in the launch that sums the pairs, `combine_pairs`, unless `LMDEPLOY_MOE_COMBINE=0`).
    """
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, double_inter, _ = gate_up_proj.shape
    inter = double_inter // 2
    assert gate_up_proj.shape == (num_experts, 2 * inter, hidden), f'bad gate_up_proj {tuple(gate_up_proj.shape)}'
    assert down_proj.shape == (num_experts, hidden, inter), f'bad down_proj {tuple(down_proj.shape)}'
    assert topk_weights.shape == topk_ids.shape == (num_tokens, top_k)
    if num_tokens == 0 or top_k == 0:
        return add_gated_shared(torch.zeros_like(x), gated_shared)
    if x.stride(-1) != 1:
        x = x.contiguous()
    gate_up_proj = gate_up_proj if gate_up_proj.stride(-1) == 1 else gate_up_proj.contiguous()
    down_proj = down_proj if down_proj.stride(-1) == 1 else down_proj.contiguous()
    shared_gate_up, shared_down = shared if shared is not None else (gate_up_proj, down_proj)
    if shared is not None:
        assert shared_gate_up.shape == gate_up_proj.shape[1:] and shared_down.shape == down_proj.shape[1:]
        assert shared_gate_up.stride() == gate_up_proj.stride()[1:] and shared_down.stride() == down_proj.stride()[1:]
        assert shared_gate_up.dtype == gate_up_proj.dtype and shared_down.dtype == down_proj.dtype
    has_shared = int(shared is not None)
    if _MOE_GEMV and config is None:
        if num_tokens <= moe_gemv.MAX_TOKENS:
            return add_gated_shared(moe_gemv.fused_moe_gemv(x, gate_up_proj, down_proj, topk_weights, topk_ids,
                                                            shared), gated_shared)
    num_pairs = num_tokens * top_k
    if config is None:
        name = _device_name(x.device)
        config = _call_config(num_pairs, num_experts, hidden, inter, name, x.dtype != torch.float32)
    block_m = config.block_m
    sorted_pairs, block_expert = align_expert_pairs(topk_ids, num_experts + has_shared, block_m)
    num_blocks = block_expert.shape[0]
    precision = 'ieee' if x.dtype == torch.float32 else 'tf32'
    order = cols_first(num_pairs, num_experts, block_m)

    act = torch.empty(sorted_pairs.shape[0], inter, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = config.up
    _moe_up_kernel[expert_grid(num_blocks, triton.cdiv(inter, block_n), order)](
        x, gate_up_proj, shared_gate_up, act, sorted_pairs, block_expert, num_pairs=num_pairs, hidden=hidden,
        inter=inter, stride_xt=x.stride(0), stride_we=gate_up_proj.stride(0), stride_wn=gate_up_proj.stride(1),
        stride_wk=gate_up_proj.stride(2), stride_ot=act.stride(0), TOP_K=top_k, NUM_EXPERTS=num_experts,
        HAS_SHARED=has_shared, PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        COLS_FIRST=order, num_warps=warps, num_stages=stages)

    per_pair = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()
    block_n, block_k, warps, stages = config.down
    _moe_down_kernel[expert_grid(num_blocks, triton.cdiv(hidden, block_n), order)](
        act, down_proj, shared_down, per_pair, weights, sorted_pairs, block_expert, num_pairs=num_pairs,
        hidden=hidden, inter=inter, stride_at=act.stride(0), stride_we=down_proj.stride(0),
        stride_wn=down_proj.stride(1), stride_wk=down_proj.stride(2), stride_ot=per_pair.stride(0),
        NUM_EXPERTS=num_experts, HAS_SHARED=has_shared, PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, COLS_FIRST=order, num_warps=warps, num_stages=stages)
    if gated_shared is not None and _COMBINE:
        return combine_pairs(per_pair, top_k, gated_shared)
    return add_gated_shared(per_pair.view(num_tokens, top_k, hidden).sum(dim=1), gated_shared)


def warm_up_token_counts(num_experts: int, hidden: int, inter: int, top_k: int, max_tokens: int,
                         device_name: str | None, half: bool = True) -> list[int]:
    """Token counts in 1..`max_tokens` whose calls reach every (config, class of the pair count, alignment launch,
    program order) that any count there reaches (through this shape's table for `device_name`, or the untuned
    tiles; `half`: as `default_config`'s): the first count of each."""
    def key(tokens: int) -> tuple:
        config = _call_config(tokens * top_k, num_experts, hidden, inter, device_name, half)
        return config, *pair_count_key(tokens * top_k, num_experts, config.block_m)
    return first_counts(max_tokens, key)


def first_counts(max_tokens: int, key) -> list[int]:
    """The first token count in 1..`max_tokens` of each distinct `key(tokens)`, sorted (the warm-ups' counts)."""
    first = {}
    for tokens in range(1, max_tokens + 1):
        first.setdefault(key(tokens), tokens)
    return sorted(first.values())


def pair_count_key(num_pairs: int, num_experts: int, block_m: int) -> tuple:
    """What of a call's compiled binaries the pair count decides beyond the tiles: its integer class (the GEMMs'
    `num_pairs`), the alignment's launch and the GEMMs' program order (`cols_first`)."""
    return arg_key(num_pairs), align_launch_key(num_pairs), cols_first(num_pairs, num_experts, block_m)


def warm_up_inputs(tokens: int, hidden: int, top_k: int, num_experts: int, dtype: torch.dtype,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x zeros [tokens, hidden], equal routing weights, distinct expert ids [tokens, top_k]) of a warm-up call."""
    x = torch.zeros(tokens, hidden, dtype=dtype, device=device)
    ids = (torch.arange(tokens, device=device)[:, None] + torch.arange(top_k, device=device)) % num_experts
    return x, torch.full((tokens, top_k), 1.0 / top_k, dtype=dtype, device=device), ids


def warm_up_tiles(gate_up_proj: torch.Tensor, down_proj: torch.Tensor, top_k: int, max_tokens: int,
                  shared: tuple[torch.Tensor, torch.Tensor] | None = None, shared_max_tokens: int = 0) -> int:
    """Compile every binary `fused_moe` can pick for these experts in forwards of 1..`max_tokens` tokens
    (`warm_up_token_counts`; the other integer arguments are fixed by the shape), and with `shared` those of the
    calls that run it as one more expert (top_k + 1 columns) in forwards of up to `shared_max_tokens`. Returns the
    number of calls; 0 off CUDA."""
    device = gate_up_proj.device
    name = _device_name(device)
    if name is None:
        return 0
    num_experts, double_inter, hidden = gate_up_proj.shape
    runs = [(top_k, max_tokens, None)]
    if shared is not None:
        runs.append((top_k + 1, min(max_tokens, shared_max_tokens), shared))
    calls = 0
    for k, limit, with_shared in runs:
        for tokens in warm_up_token_counts(num_experts, hidden, double_inter // 2, k, limit, name,
                                           gate_up_proj.dtype != torch.float32):
            x, weights, ids = warm_up_inputs(tokens, hidden, k, num_experts, gate_up_proj.dtype, device)
            if with_shared is not None:
                ids[:, -1] = num_experts
            fused_moe(x, gate_up_proj, down_proj, weights, ids, shared=with_shared)
            calls += 1
    return calls
