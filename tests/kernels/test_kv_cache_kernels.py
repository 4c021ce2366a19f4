"""Triton cache-copy and KV-fill kernels (`copy_packed_cache`, `copy_state_slots`, `fill_kv_cache`, the state rows'
gather and scatter of `state_rows`) against their pure-torch references.

The same case checkers run twice:
- on the CPU under the Triton interpreter (tiny shapes), in a subprocess started with TRITON_INTERPRET=1, because
  Triton decides at `@triton.jit` time whether a kernel is interpreted;
- on the GPU (`@pytest.mark.gpu`, odd shapes), in this process.

KV caches are strided K/V views of a packed page pool (`paged_kv_pool.py`); slots the fill does not write must stay
NaN, bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from interpreted import check_cases_interpreted, run_checks_interpreted
from paged_kv_pool import DTYPES, make_kv_pool

from lmdeploy.pytorch.kernels.cuda.copy_packed_cache import copy_packed_cache, copy_state_slots
from lmdeploy.pytorch.kernels.cuda.fill_kv_cache import fill_kv_cache
from lmdeploy.pytorch.kernels.cuda.state_rows import gather_state_rows, scatter_state_rows
from lmdeploy.pytorch.kernels.default import cache_copy as ref_copy
from lmdeploy.pytorch.kernels.default import gated_delta_rule as ref_gdr
from lmdeploy.pytorch.kernels.default import paged_attention as ref_attn

# --------------------------------------------------------------------------------------------- copy_packed_cache


@dataclass(frozen=True)
class CopyCase:
    lead: tuple[int, ...]      # leading (layer) dims
    pages_per_block: int
    page_bytes: int
    num_blocks: int
    pairs: tuple[tuple[int, int], ...]
    byte_offset: int = 0       # storage offset of the pool inside its buffer (alignment fallback)

    @property
    def id(self) -> str:
        lead = 'x'.join(map(str, self.lead))
        return f'L{lead}-ppb{self.pages_per_block}-PB{self.page_bytes}-N{len(self.pairs)}-off{self.byte_offset}'


def check_copy(case: CopyCase, device: str) -> None:
    gen = torch.Generator().manual_seed(len(case.pairs) * 131 + case.page_bytes)
    num_pages = case.num_blocks * case.pages_per_block
    numel = torch.Size([*case.lead, num_pages, case.page_bytes]).numel()
    buffer = torch.randint(0, 256, (numel + case.byte_offset,), dtype=torch.uint8, generator=gen).to(device)
    pool = buffer[case.byte_offset:].view(*case.lead, num_pages, case.page_bytes)
    expected = pool.clone()
    head = buffer[:case.byte_offset].clone()
    src = torch.tensor([s for s, _ in case.pairs], dtype=torch.int64, device=device)
    dst = torch.tensor([d for _, d in case.pairs], dtype=torch.int64, device=device)
    ref_copy.copy_packed_cache(expected, src, dst, case.pages_per_block)
    copy_packed_cache(pool, src, dst, case.pages_per_block, debug=True)
    assert torch.equal(pool, expected), case.id
    assert torch.equal(buffer[:case.byte_offset], head), case.id


COPY_CASES_CPU = [
    CopyCase((2,), 1, 48, 6, ((0, 3), (5, 1), (2, 4))),
    CopyCase((2,), 2, 48, 5, ((4, 0), (1, 2))),
    CopyCase((2,), 4, 96, 4, ((3, 1), (0, 2))),
    CopyCase((2,), 1, 7, 6, ((1, 4), (0, 3), (2, 5))),           # odd bytes: uint8 words
    CopyCase((2,), 2, 6, 5, ((1, 4),)),                           # 12-byte blocks: int32 words
    CopyCase((2,), 4, 96, 3, ()),                                 # empty plan: no launch
    CopyCase((2, 3), 2, 48, 4, ((0, 3), (2, 1))),                 # several leading dims
    CopyCase((2,), 2, 48, 4, ((3, 0),), byte_offset=4),           # 4-byte-aligned pool: int32 words
]

COPY_CASES_GPU = [
    CopyCase((48,), 1, 2 * 64 * 2 * 256 * 2, 24, tuple((i, 12 + i) for i in range(8))),
    CopyCase((48,), 4, 2 * 16 * 2 * 256 * 2, 20, tuple((2 * i + 1, 2 * i + 10) for i in range(5))),
    CopyCase((3,), 2, 48, 9, ((8, 0), (1, 7), (2, 6), (3, 5))),
    CopyCase((3,), 4, 13, 7, ((6, 0), (1, 5))),
    CopyCase((5,), 1, 2 * 16 * 2 * 80 * 2, 9, ()),
    CopyCase((2,), 2, 48, 4, ((3, 0), (1, 2)), byte_offset=2),
]


# --------------------------------------------------------------------------------------------- copy_state_slots
@dataclass(frozen=True)
class StateCase:
    num_slots: int
    row_bytes: int              # a multiple of 16 in the engine; odd ones take narrower words
    pairs: tuple[tuple[int, int], ...]

    @property
    def id(self) -> str:
        return f'S{self.num_slots}-R{self.row_bytes}-N{len(self.pairs)}'


def check_state_copy(case: StateCase, device: str) -> None:
    gen = torch.Generator().manual_seed(case.row_bytes + len(case.pairs))
    pool = torch.randint(0, 256, (case.num_slots, case.row_bytes), dtype=torch.uint8, generator=gen).to(device)
    expected = pool.clone()
    src = torch.tensor([s for s, _ in case.pairs], dtype=torch.int64, device=device)
    dst = torch.tensor([d for _, d in case.pairs], dtype=torch.int64, device=device)
    ref_copy.copy_state_slots(expected, src, dst)
    copy_state_slots(pool, src, dst, debug=True)
    assert torch.equal(pool, expected), case.id


STATE_CASES_CPU = [
    StateCase(6, 4112, ((0, 3), (5, 1))),
    StateCase(4, 37, ((2, 0),)),
]
STATE_CASES_GPU = [
    StateCase(8, 49 << 20, ((1, 6), (7, 2), (3, 0))),   # a Qwen3.5-9B-sized row, restores and saves in one plan
    StateCase(5, 4112, ((0, 4),)),
    StateCase(4, 37, ((2, 0), (1, 3))),
    StateCase(3, 64, ()),
]

# --------------------------------------------------------------------------------------------- state rows
@dataclass(frozen=True)
class RowsCase:
    """fla's dense states <-> state-pool slots (`state_rows`): a pool view [S, *shape] whose slot stride is a row of
    `row_words` words of the pool dtype (>= the block: other layers' states sit in the rest of the row)."""
    num_slots: int
    shape: tuple[int, ...]
    row_words: int
    ids: tuple[int, ...]
    fresh: tuple[bool, ...]
    dtype: str = 'float32'

    @property
    def id(self) -> str:
        return f'S{self.num_slots}-{"x".join(map(str, self.shape))}-R{self.row_words}-B{len(self.ids)}-{self.dtype}'


def check_state_rows(case: RowsCase, device: str) -> None:
    dtype = getattr(torch, case.dtype)
    gen = torch.Generator().manual_seed(case.row_words + len(case.ids))
    rows = torch.randn(case.num_slots, case.row_words, generator=gen).to(dtype)
    block = torch.Size(case.shape).numel()
    rows[:, :block].view(case.num_slots, *case.shape)[0] = float('nan')  # slot 0 holds garbage (fresh reads skip it)
    rows = rows.to(device)
    pool = rows[:, :block].view(case.num_slots, *case.shape)
    ids = torch.tensor(case.ids, dtype=torch.int64, device=device)
    fresh = torch.tensor(case.fresh, dtype=torch.bool, device=device)
    got = gather_state_rows(pool, ids, fresh)
    assert got.dtype == torch.float32 and got.is_contiguous(), case.id
    assert torch.equal(got, ref_gdr._load_states(pool, ids, fresh)), case.id   # exact, fresh rows 0 (not NaN)
    final = torch.randn(len(case.ids), *case.shape, generator=gen).to(device)
    expected = rows.clone()
    ref_gdr._store_states(expected[:, :block].view(case.num_slots, *case.shape), ids, final)
    scatter_state_rows(pool, ids, final)
    got, expected = rows.nan_to_num(7.0), expected.nan_to_num(7.0)  # the rest of each row untouched, NaN included
    if device == 'cpu' and dtype != torch.float32:  # the interpreter's float32 -> half cast truncates (GPU: nearest)
        torch.testing.assert_close(got, expected, rtol=2 ** -7, atol=0, msg=case.id)
    else:
        assert torch.equal(got, expected), case.id


STATE_ROWS_CASES_CPU = [
    RowsCase(5, (2, 4, 8), 80, (3, 0, 1), (False, True, False)),
    RowsCase(4, (3, 5, 7), 120, (2,), (False,), 'bfloat16'),               # odd sizes, a half-precision pool
    RowsCase(3, (2, 4, 4), 32, (), ()),                                      # no sequence: no launch
]
STATE_ROWS_CASES_GPU = [
    RowsCase(6, (32, 128, 128), 32 * 128 * 128 + 4096, (4, 0, 2, 5), (False, True, False, False)),  # 9B / 80B layer
    RowsCase(4, (3, 5, 7), 120, (2, 1), (True, False), 'bfloat16'),
    RowsCase(3, (16, 128, 128), 16 * 128 * 128, (1,), (False,)),              # slots back to back
]

# --------------------------------------------------------------------------------------------- fill_kv_cache


@dataclass(frozen=True)
class FillCase:
    num_tokens: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    src_dtype: str = ''       # K/V dtype when it differs from the cache's
    num_padding: int = 0      # extra rows with slot -1 (CUDA-graph padding): write nothing

    @property
    def id(self) -> str:
        src = f'-from{self.src_dtype}' if self.src_dtype else ''
        pad = f'-pad{self.num_padding}' if self.num_padding else ''
        return f'T{self.num_tokens}-H{self.num_kv_heads}-D{self.head_dim}-kbs{self.page_size}-{self.dtype}{src}{pad}'


def check_fill(case: FillCase, device: str) -> None:
    gen = torch.Generator().manual_seed(case.num_tokens * 7 + case.head_dim)
    dtype, src_dtype = DTYPES[case.dtype], DTYPES[case.src_dtype or case.dtype]
    num_pages = case.num_tokens // case.page_size + 3
    pool, k_cache, v_cache = make_kv_pool(num_pages, case.page_size, case.num_kv_heads, case.head_dim, dtype, device)
    expected_pool = pool.clone()
    exp_k, exp_v = (expected_pool.view(dtype).view(num_pages, 2, case.page_size, case.num_kv_heads,
                                                   case.head_dim)[:, i] for i in (0, 1))
    total = case.num_tokens + case.num_padding
    shape = (total, case.num_kv_heads, case.head_dim)
    k = torch.randn(shape, generator=gen).to(device=device, dtype=src_dtype)
    v = torch.randn(shape, generator=gen).to(device=device, dtype=src_dtype)
    slots = torch.randperm(num_pages * case.page_size, generator=gen)[:case.num_tokens]
    slots = torch.cat([slots, torch.full((case.num_padding,), -1, dtype=torch.int64)])
    order = torch.randperm(total, generator=gen)
    k, v, slots = k[order], v[order], slots[order].to(device)
    real = slots >= 0
    ref_attn.fill_kv_cache(k[real], v[real], exp_k, exp_v, slots[real])
    fill_kv_cache(k, v, k_cache, v_cache, slots)
    if case.src_dtype and device == 'cpu':
        # The interpreter rounds float downcasts toward zero; the GPU rounds to nearest even, like torch.
        torch.testing.assert_close(k_cache, exp_k, rtol=2 ** -7, atol=0, equal_nan=True, msg=case.id)
        torch.testing.assert_close(v_cache, exp_v, rtol=2 ** -7, atol=0, equal_nan=True, msg=case.id)
    else:
        assert torch.equal(pool, expected_pool), case.id


FILL_CASES_CPU = [
    FillCase(0, 2, 16, 4, 'fp32'),
    FillCase(1, 2, 16, 4, 'fp32'),
    FillCase(7, 2, 80, 4, 'fp32', num_padding=2),
    FillCase(13, 3, 16, 16, 'bf16'),
    FillCase(9, 2, 16, 4, 'bf16', src_dtype='fp32'),
]

FILL_CASES_GPU = [
    FillCase(t, 2, d, kbs, dtype)
    for t in (0, 1, 7, 130) for d in (64, 128, 256) for kbs in (16, 64) for dtype in ('bf16', 'fp32')
] + [
    FillCase(130, 2, 80, 16, 'bf16'),
    FillCase(64, 8, 128, 64, 'bf16', src_dtype='fp32'),
    FillCase(7, 2, 128, 16, 'bf16', num_padding=5),
    FillCase(300, 16, 128, 16, 'fp16'),
]


# --------------------------------------------------------------------------------------------- CPU (interpreter)


_CHECKS = {
    'copy_packed_cache': (check_copy, COPY_CASES_CPU),
    'copy_state_slots': (check_state_copy, STATE_CASES_CPU),
    'fill_kv_cache': (check_fill, FILL_CASES_CPU),
    'state_rows': (check_state_rows, STATE_ROWS_CASES_CPU),
}


def run_interpreted(kernel: str) -> None:
    """Entry point of the interpreter subprocess: every CPU case of one kernel."""
    check_cases_interpreted(*_CHECKS[kernel])


@pytest.mark.parametrize('kernel', list(_CHECKS))
def test_kernel_under_triton_interpreter(kernel):
    run_checks_interpreted(__file__, kernel, len(_CHECKS[kernel][1]))


# --------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize('case', COPY_CASES_GPU, ids=lambda c: c.id)
def test_copy_packed_cache_matches_reference(case):
    check_copy(case, 'cuda')


@pytest.mark.gpu
@pytest.mark.parametrize('case', STATE_CASES_GPU, ids=lambda c: c.id)
def test_copy_state_slots_matches_reference(case):
    check_state_copy(case, 'cuda')


@pytest.mark.gpu
@pytest.mark.parametrize('case', FILL_CASES_GPU, ids=lambda c: c.id)
def test_fill_kv_cache_matches_reference(case):
    check_fill(case, 'cuda')


@pytest.mark.gpu
@pytest.mark.parametrize('case', STATE_ROWS_CASES_GPU, ids=lambda c: c.id)
def test_state_rows_match_reference(case):
    check_state_rows(case, 'cuda')
