"""Recurrent states between the pool and fla's dense arguments, one launch each way (reference: `_load_states` /
`_store_states` of `kernels/default/gated_delta_rule.py`).

fla's chunked and recurrent rules take the initial states as a dense float32 ``[B, H, K, V]`` tensor and return the
final ones the same way; the pool holds them in rows of slots (`engine/cache_engine.py`: a view ``[S, H, K, V]``
whose slot stride is the whole state row's, each slot's block contiguous). In torch ops the way in is an indexed
gather, a dtype conversion and a masked fill of the fresh rows, and the way out an indexed put: three to four
launches a gated DeltaNet layer whose elementwise index kernels ran at a fraction of the copy rate (H200 run 55:
~0.9 ms of a Qwen3-Next-80B-shaped prefill's 15 ms for 2 MiB a layer). Here each direction is one copy kernel:
program ``(b, c)`` moves chunk ``c`` of sequence ``b``'s block.

- `gather_state_rows`: row ``b`` of the result is slot ``state_ids[b]`` in float32, or zeros where ``is_fresh[b]``
  (the slot is not read then, so stale contents, NaN included, never reach the result).
- `scatter_state_rows`: slot ``state_ids[b]`` := row ``b`` in the pool's dtype. Slots of real sequences are
  distinct; padding sequences of a CUDA graph may share the dummy slot, whose contents nobody reads.
Values are copied exactly (a float32 pool, the default, round-trips bit for bit; a half-precision pool takes the
rounded float32 final states, to nearest even as torch's cast; the Triton interpreter truncates instead). No host
synchronisation.

On by default since H100 runs 58-63 (its gpu tests and the hybrid engine, graph and warm-start tests pass with it;
docs/benchmarks.md); `LMDEPLOY_STATE_ROWS=0` (read at import) keeps the masked fill and index put.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .launch import fast_kernel, wait_for_inputs

ENABLED = os.environ.get('LMDEPLOY_STATE_ROWS', '1') != '0'
_BLOCK = 4096  # elements a program moves (32 a thread at 4 warps)


@fast_kernel
@triton.jit
def _rows_kernel(pool_ptr, ids_ptr, fresh_ptr, dense_ptr, row_numel, stride_slot, GATHER: tl.constexpr,
                 BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """GATHER: dense row `seq` := pool slot `ids[seq]` in float32 (zeros where fresh); else the reverse, cast to the
    pool's dtype."""
    wait_for_inputs(PDL)
    seq = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_numel
    slot = tl.load(ids_ptr + seq).to(tl.int64)
    pool_row = pool_ptr + slot * stride_slot + offs
    dense_row = dense_ptr + seq * row_numel + offs
    if GATHER:
        has_state = tl.load(fresh_ptr + seq) == 0
        # scalar conditions enter masks through tl.where (the interpreter mis-types scalar & vector)
        vals = tl.load(pool_row, mask=tl.where(has_state, mask, False), other=0.0)
        tl.store(dense_row, vals.to(tl.float32), mask=mask)
    else:
        vals = tl.load(dense_row, mask=mask)
        tl.store(pool_row, vals.to(pool_ptr.dtype.element_ty), mask=mask)


def slots_contiguous(pool: torch.Tensor) -> bool:
    """Whether each slot's block of `pool` ([S, ...]) is contiguous (the layout the kernels address)."""
    return pool[:1].squeeze(0).is_contiguous() if pool.size(0) else True


def gather_state_rows(pool: torch.Tensor, state_ids: torch.Tensor, is_fresh: torch.Tensor) -> torch.Tensor:
    """A new contiguous float32 ``[B, *pool.shape[1:]]``: slot ``state_ids[b]`` of `pool`, zeros where fresh."""
    assert slots_contiguous(pool), 'each slot of the state pool must be contiguous'
    batch = state_ids.numel()
    out = torch.empty((batch, *pool.shape[1:]), dtype=torch.float32, device=pool.device)
    row_numel = out[0].numel() if batch else 0
    if batch == 0 or row_numel == 0:
        return out
    fresh = is_fresh.view(torch.uint8) if is_fresh.dtype == torch.bool else is_fresh
    _rows_kernel[(batch, triton.cdiv(row_numel, _BLOCK))](
        pool, state_ids, fresh, out, row_numel, pool.stride(0), GATHER=True, BLOCK=_BLOCK, num_warps=4)
    return out


def scatter_state_rows(pool: torch.Tensor, state_ids: torch.Tensor, rows: torch.Tensor) -> None:
    """Slot ``state_ids[b]`` of `pool` := ``rows[b]`` (cast to the pool's dtype), in place."""
    assert slots_contiguous(pool), 'each slot of the state pool must be contiguous'
    batch = state_ids.numel()
    assert rows.shape == (batch, *pool.shape[1:]), f'rows {tuple(rows.shape)} do not fit pool {tuple(pool.shape)}'
    row_numel = rows[0].numel() if batch else 0
    if batch == 0 or row_numel == 0:
        return
    rows = rows.contiguous()
    _rows_kernel[(batch, triton.cdiv(row_numel, _BLOCK))](
        pool, state_ids, state_ids, rows, row_numel, pool.stride(0), GATHER=False, BLOCK=_BLOCK, num_warps=4)
