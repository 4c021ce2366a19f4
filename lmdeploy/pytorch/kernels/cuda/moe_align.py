"""Triton MoE alignment: group the (token, expert) pairs by expert in one or three launches, not ~20 torch ops.

Contract (`moe.py` step 1, `align_pairs_reference` below): for the ``N = T * top_k`` pairs (flattened ``topk_ids``)
and ``BLOCK_M``, each expert's pairs occupy a run of ``sorted_pairs`` that starts at the sum of the previous
experts' counts rounded up to ``BLOCK_M`` and is padded with the sentinel ``N`` to a multiple of ``BLOCK_M``;
``block_expert[b]`` is the expert of rows ``[b * BLOCK_M, (b + 1) * BLOCK_M)``, or ``E`` past the last run. Buffers
hold ``max_blocks = cdiv(N, BLOCK_M) + min(E, N)`` blocks (the bound of the module docstring of `moe.py`).

Within an expert's run the pairs' order is not specified (the scatter takes ranks with atomics); the expert GEMMs
compute every row independently and write each pair's result to row ``pair``, so the MoE output does not depend
on it. Launches: count (atomic histogram), offsets (one program: padded prefix sums, ``block_expert``, sentinel
fill), scatter (each pair takes the next row of its expert's run). Up to ``ONE_LAUNCH_PAIRS`` pairs (a suffix or a
short prompt, where each of the three launches and the counts' memset costs a few microseconds of latency) one
program does all of it: the counts as a histogram in registers (no memset), the offsets and the fill, then, after
a barrier, the scatter (the default since H100 run 50 of 2026-12-07: 12.4 us against 15.8 for 100 tokens, the same
groups; ``LMDEPLOY_MOE_ALIGN=triton`` keeps the three launches for every count). Above that, two launches (the
default since H100 run 80 of 2026-12-07): each program of 1024 pairs writes its expert histogram (registers) to a
row of a ``[programs, E]`` table, with no memset and no atomics on shared counters; then each program reads the
table, lays out the runs, fills its share of ``block_expert`` and of the padding rows (only rows no pair takes) and
places its own pairs by atomics on its own row of cursors. The three launches' atomics all land on E counters, and
8,192 to 65,536 pairs queue on them: 21.9 -> 11.0 us at 8,192 pairs and 75.6 -> 14.2 us at 65,536 (BLOCK_M 64), a
35B-A3B-shaped model's cold 8K prompt 148.1 -> 129.9 ms on the H100 (``LMDEPLOY_MOE_ALIGN=three`` keeps them above
the one program's limit).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .launch import fast_kernel, wait_for_inputs

_PAIRS_PER_PROGRAM = 1024
_COMPARE_ELEMS = 4096  # blocks x experts compared per step of the offsets program
_FILL = 1024  # sentinel elements per step of the offsets program
ONE_LAUNCH_PAIRS = 2048  # the most pairs `align_pairs` groups in one program (`_align_one_kernel`)
_ONE_LAUNCH_SMALL = 256  # up to this many pairs the one program runs 8 warps, above `_ONE_LAUNCH_WARPS`
_ONE_LAUNCH_WARPS = int(os.environ.get('LMDEPLOY_MOE_ALIGN_WARPS', '16'))


_MODES = ('one', 'three', 'triton', 'torch')


def align_mode() -> str:
    """`LMDEPLOY_MOE_ALIGN`: `one` (default: one program up to `ONE_LAUNCH_PAIRS` pairs, two launches above),
    `three` (one program up to `ONE_LAUNCH_PAIRS`, three launches above: the form before H100 run 80), `triton`
    (three launches at every count) or `torch` (`align_pairs_reference`, used by `moe.py`)."""
    mode = os.environ.get('LMDEPLOY_MOE_ALIGN', 'one')
    if mode not in _MODES:
        raise ValueError(f'LMDEPLOY_MOE_ALIGN must be one of {", ".join(map(repr, _MODES))}, got {mode!r}')
    return mode


_MODE = align_mode()  # read at import


@fast_kernel
@triton.jit(do_not_specialize=['num_pairs'])
def _count_kernel(ids_ptr, counts_ptr, num_pairs, num_experts, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_pairs
    expert = tl.load(ids_ptr + offs, mask=mask, other=0)
    mask = mask & (expert >= 0) & (expert < num_experts)  # memory safety: an invalid id is never counted
    tl.atomic_add(counts_ptr + expert, 1, mask=mask)


@triton.jit
def lay_out_runs(counts, experts, valid, cursor_ptr, block_expert_ptr, sorted_pairs_ptr, num_pairs, max_blocks,
                 BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr):
    """From the experts' pair counts: each run's first row into the cursors, `block_expert`, and the sentinel in
    every row of `sorted_pairs` (the scatter then overwrites the rows that hold pairs)."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(cursor_ptr + experts, ends - padded, mask=valid)
    for b0 in range(0, max_blocks, CHUNK):
        blocks = b0 + tl.arange(0, CHUNK)
        # searchsorted(ends, block start, right=True): experts whose run ends at or before the block's first row
        done = (ends[None, :] <= (blocks * BLOCK_M)[:, None]) & valid[None, :]
        tl.store(block_expert_ptr + blocks, tl.sum(done.to(tl.int64), axis=1), mask=blocks < max_blocks)
    total = max_blocks * BLOCK_M
    sentinel = tl.full([FILL], 0, tl.int64) + num_pairs
    for s0 in range(0, total, FILL):
        rows = s0 + tl.arange(0, FILL)
        tl.store(sorted_pairs_ptr + rows, sentinel, mask=rows < total)


@fast_kernel
@triton.jit(do_not_specialize=['num_pairs', 'max_blocks'])
def _offsets_kernel(counts_ptr, cursor_ptr, block_expert_ptr, sorted_pairs_ptr, num_experts, num_pairs, max_blocks,
                    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr,
                    PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    counts = tl.load(counts_ptr + experts, mask=valid, other=0)
    lay_out_runs(counts, experts, valid, cursor_ptr, block_expert_ptr, sorted_pairs_ptr, num_pairs, max_blocks,
                 BLOCK_M, CHUNK, FILL)


@fast_kernel
@triton.jit(do_not_specialize=['num_pairs'])
def _scatter_kernel(ids_ptr, cursor_ptr, sorted_pairs_ptr, num_pairs, num_experts, BLOCK: tl.constexpr,
                    PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_pairs
    expert = tl.load(ids_ptr + offs, mask=mask, other=0)
    mask = mask & (expert >= 0) & (expert < num_experts)
    row = tl.atomic_add(cursor_ptr + expert, 1, mask=mask)
    tl.store(sorted_pairs_ptr + row, offs.to(tl.int64), mask=mask)


@fast_kernel
@triton.jit(do_not_specialize=['num_pairs', 'max_blocks'])
def _align_one_kernel(ids_ptr, cursor_ptr, block_expert_ptr, sorted_pairs_ptr, num_pairs, num_experts, max_blocks,
                      BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                      FILL: tl.constexpr, PDL: tl.constexpr = False):
    """The three launches' work in one program (BLOCK_E > num_experts: its last bin takes the masked and invalid
    ids, which are never placed)."""
    wait_for_inputs(PDL)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for p0 in range(0, num_pairs, BLOCK):
        offs = p0 + tl.arange(0, BLOCK)
        expert = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
        ok = (offs < num_pairs) & (expert >= 0) & (expert < num_experts)
        counts += tl.histogram(tl.where(ok, expert, BLOCK_E - 1).to(tl.int32), BLOCK_E)
    lay_out_runs(tl.where(valid, counts, 0), experts, valid, cursor_ptr, block_expert_ptr, sorted_pairs_ptr,
                 num_pairs, max_blocks, BLOCK_M, CHUNK, FILL)
    # the cursors and the fill above are visible to every thread of the program before any pair is placed
    tl.debug_barrier()
    for p0 in range(0, num_pairs, BLOCK):
        offs = p0 + tl.arange(0, BLOCK)
        expert = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=0)
        ok = (offs < num_pairs) & (expert >= 0) & (expert < num_experts)
        row = tl.atomic_add(cursor_ptr + expert, 1, mask=ok)
        tl.store(sorted_pairs_ptr + row, offs.to(tl.int64), mask=ok)


@fast_kernel
@triton.jit(do_not_specialize=['num_pairs'])
def _histogram_kernel(ids_ptr, table_ptr, num_pairs, num_experts, BLOCK_E: tl.constexpr, BLOCK: tl.constexpr,
                      PDL: tl.constexpr = False):
    """Program p: the expert histogram of pairs [p * BLOCK, (p + 1) * BLOCK) into row p of `table` [programs, E]
    (registers, no atomics, no memset; BLOCK_E > num_experts: its last bin takes masked and invalid ids)."""
    wait_for_inputs(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    expert = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
    ok = (offs < num_pairs) & (expert >= 0) & (expert < num_experts)
    counts = tl.histogram(tl.where(ok, expert, BLOCK_E - 1).to(tl.int32), BLOCK_E)
    experts = tl.arange(0, BLOCK_E)
    tl.store(table_ptr + tl.program_id(0).to(tl.int64) * num_experts + experts, counts, mask=experts < num_experts)


@fast_kernel
@triton.jit(do_not_specialize=['num_pairs', 'num_programs', 'max_blocks'])
def _place_kernel(ids_ptr, table_ptr, cursor_ptr, block_expert_ptr, sorted_pairs_ptr, num_pairs, num_experts,
                  num_programs, max_blocks, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK: tl.constexpr,
                  TABLE_ROWS: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    """Program p, from the histograms' table: every expert's count and run start, and p's own first row in each run
    (the run start plus the pairs of that expert in programs before p); p's share of `block_expert` and of the
    padding rows' sentinel (only rows no pair takes, so no program's fill races another's scatter), then its pairs
    placed by atomics on its own row of cursors (contention only within the program)."""
    wait_for_inputs(PDL)
    pid = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    before = tl.zeros([BLOCK_E], dtype=tl.int32)
    for q0 in range(0, num_programs, TABLE_ROWS):
        q = q0 + tl.arange(0, TABLE_ROWS)
        part = tl.load(table_ptr + q.to(tl.int64)[:, None] * num_experts + experts[None, :],
                       mask=(q < num_programs)[:, None] & valid[None, :], other=0)
        counts += tl.sum(part, axis=0)
        before += tl.sum(tl.where((q < pid)[:, None], part, 0), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    cursors = cursor_ptr + pid.to(tl.int64) * num_experts + experts
    tl.store(cursors, starts + before, mask=valid)
    # this program's blocks: each block's expert (searchsorted(ends, block start, right=True)) and the rows of it
    # that no pair takes (past its expert's count, or the whole block past the last run) set to the sentinel
    share = tl.cdiv(max_blocks, num_programs)
    rows_in_block = tl.arange(0, BLOCK_M)
    for b0 in range(pid * share, tl.minimum((pid + 1) * share, max_blocks), CHUNK):
        blocks = b0 + tl.arange(0, CHUNK)
        in_share = (blocks < max_blocks) & (blocks < (pid + 1) * share)
        first = (blocks * BLOCK_M)[:, None]
        done = (ends[None, :] <= first) & valid[None, :]
        tl.store(block_expert_ptr + blocks, tl.sum(done.to(tl.int64), axis=1), mask=in_share)
        in_run = (starts[None, :] <= first) & (first < ends[None, :]) & valid[None, :]
        taken = tl.sum(tl.where(in_run, tl.minimum(tl.maximum(counts[None, :] - (first - starts[None, :]), 0),
                                                   BLOCK_M), 0), axis=1)
        row_ids = blocks[:, None] * BLOCK_M + rows_in_block[None, :]
        pad = in_share[:, None] & (rows_in_block[None, :] >= taken[:, None])
        tl.store(sorted_pairs_ptr + row_ids, tl.full([CHUNK, BLOCK_M], 0, tl.int64) + num_pairs, mask=pad)
    # the cursors above are visible to every thread of the program before any pair is placed
    tl.debug_barrier()
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    expert = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=0)
    ok = (offs < num_pairs) & (expert >= 0) & (expert < num_experts)
    row = tl.atomic_add(cursor_ptr + pid.to(tl.int64) * num_experts + expert, 1, mask=ok)
    tl.store(sorted_pairs_ptr + row, offs.to(tl.int64), mask=ok)


def align_form(num_pairs: int) -> str:
    """How `align_pairs` groups this many pairs: `one` program, `two` launches or `three` (the warm-up compiles
    each form apart)."""
    if _MODE == 'triton':
        return 'three'
    return 'one' if num_pairs <= ONE_LAUNCH_PAIRS else 'three' if _MODE == 'three' else 'two'


def align_launch_key(num_pairs: int) -> tuple[str, int]:
    """What of `align_pairs`' launches depends on the pair count beyond BLOCK_M: the form and the one program's
    warps (the size ints are compiled unspecialized, `do_not_specialize`, so that no count compiles a binary of its
    own); the start-up warm-up reaches every key it can take."""
    form = align_form(num_pairs)
    return form, one_launch_warps(num_pairs) if form == 'one' else 0


def one_launch_warps(num_pairs: int) -> int:
    """Warps of the one-program form: its pairs are placed by atomics on the experts' cursors, a few per thread in
    series (each an L2 round trip), so more pairs take more warps. H100 run 65 (`bench_moe_kernel.py`, 64 experts):
    8 warps were the fastest or within 0.1 us up to 256 pairs (8 pairs 3.9 us against 4.2 at 4 warps, 256 pairs
    6.3 against 7.5), 16 warps above (800-1024 pairs 8.2-9.4 us against 11.0-13.3 at 4 warps, 8.9-10.3 at 8)."""
    return 8 if num_pairs <= _ONE_LAUNCH_SMALL else _ONE_LAUNCH_WARPS


def _histogram_bins(num_experts: int) -> int:
    """BLOCK_E of the register histograms: more bins than experts (the last takes masked and invalid ids), a power
    of two and at least 32 (Triton's histogram)."""
    return max(32, triton.next_power_of_2(num_experts + 1))


def block_bound(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The row blocks `align_pairs` lays out (and the expert GEMMs launch) for `num_pairs` pairs of `num_experts`:
    ``cdiv(N, BLOCK_M) + min(E, N)``."""
    return triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int, form: str | None = None,
                num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [max_blocks * BLOCK_M] int64, block_expert [max_blocks] int64); see the module docstring.
    `form` (`one`, `two`, `three`; default `align_form`) and `num_warps` (the one-program form's warps, default
    `one_launch_warps`) are for tests and benchmarks."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1)
    if flat.stride(0) != 1:
        flat = flat.contiguous()
    num_pairs = flat.numel()
    max_blocks = block_bound(num_pairs, num_experts, block_m)
    sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int64, device=device)
    block_expert = torch.empty(max_blocks, dtype=torch.int64, device=device)
    if num_pairs == 0:
        return sorted_pairs, block_expert

    form = form or align_form(num_pairs)
    if form not in ('one', 'two', 'three'):
        raise ValueError(f"form must be 'one', 'two' or 'three', got {form!r}")
    if form == 'one':
        cursor = torch.empty(num_experts, dtype=torch.int32, device=device)
        block_e = _histogram_bins(num_experts)
        _align_one_kernel[(1,)](flat, cursor, block_expert, sorted_pairs, num_pairs, num_experts, max_blocks,
                                BLOCK_M=block_m, BLOCK_E=block_e, BLOCK=_PAIRS_PER_PROGRAM,
                                CHUNK=max(1, _COMPARE_ELEMS // block_e), FILL=_FILL,
                                num_warps=num_warps or one_launch_warps(num_pairs))
        return sorted_pairs, block_expert
    grid = (triton.cdiv(num_pairs, _PAIRS_PER_PROGRAM),)
    if form == 'two':
        # [histograms, cursors], the cursors 16-byte aligned whatever the program count (an alignment that moved
        # with the count would compile a binary the warm-up's key does not name)
        cursors_at = triton.cdiv(grid[0] * num_experts, 4) * 4
        table = torch.empty(cursors_at + grid[0] * num_experts, dtype=torch.int32, device=device)
        block_e = _histogram_bins(num_experts)
        _histogram_kernel[grid](flat, table, num_pairs, num_experts, BLOCK_E=block_e, BLOCK=_PAIRS_PER_PROGRAM)
        _place_kernel[grid](flat, table, table[cursors_at:], block_expert, sorted_pairs, num_pairs,
                            num_experts, grid[0], max_blocks, BLOCK_M=block_m, BLOCK_E=block_e,
                            BLOCK=_PAIRS_PER_PROGRAM, TABLE_ROWS=max(1, _COMPARE_ELEMS // block_e),
                            CHUNK=max(1, _COMPARE_ELEMS // max(block_e, block_m)), num_warps=8)
        return sorted_pairs, block_expert
    counts = torch.zeros(2 * num_experts, dtype=torch.int32, device=device)  # [counts, cursors]
    cursor = counts[num_experts:]
    _count_kernel[grid](flat, counts, num_pairs, num_experts, BLOCK=_PAIRS_PER_PROGRAM)
    block_e = triton.next_power_of_2(num_experts)
    _offsets_kernel[(1,)](counts, cursor, block_expert, sorted_pairs, num_experts, num_pairs, max_blocks,
                          BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=max(1, _COMPARE_ELEMS // block_e), FILL=_FILL,
                          num_warps=4)
    _scatter_kernel[grid](flat, cursor, sorted_pairs, num_pairs, num_experts, BLOCK=_PAIRS_PER_PROGRAM)
    return sorted_pairs, block_expert


def align_pairs_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same contract in torch ops (stable order within an expert's run); the tests' reference."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    max_blocks = block_bound(num_pairs, num_experts, block_m)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync on CUDA
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    expert_of_sorted = flat[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[expert_of_sorted]
    dest = (padded_end - padded)[expert_of_sorted] + rank
    sorted_pairs = torch.full((max_blocks * block_m,), num_pairs, dtype=torch.int64, device=device)
    sorted_pairs[dest] = order
    block_starts = torch.arange(max_blocks, device=device, dtype=torch.int64) * block_m
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    return sorted_pairs, block_expert
