"""Inputs and tolerances the kernel tests share: seeded random tensors, strided views (rows inside wider buffers,
pools whose rows are strided in dim 0) and the per-dtype tolerance of a kernel against its torch reference."""
from __future__ import annotations

import math

import pytest
import torch
from numeric import assert_close

# state pools of the kernel tests: rows in a scrambled order, so a kernel indexing by row number fails
NUM_SLOTS = 8
SLOT_ORDER = [6, 1, 4, 0, 3, 7, 2, 5]
DTYPES = pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16], ids=['fp32', 'bf16'])


def tol(dtype: torch.dtype, fp32: float = 1e-5, bf16: float = 2e-2) -> dict:
    return {'atol': fp32, 'rtol': fp32} if dtype == torch.float32 else {'atol': bf16, 'rtol': bf16}


def randn(*shape: int, gen: torch.Generator, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


def strided_copy(x: torch.Tensor, pad: int = 5) -> torch.Tensor:
    """Same values, but every row of the last dim sits in a wider buffer (non-contiguous, unit last stride; NaN
    padding that must never be read)."""
    wide = torch.full((*x.shape[:-1], x.shape[-1] + pad), float('nan'), dtype=x.dtype, device=x.device)
    wide[..., :x.shape[-1]] = x
    return wide[..., :x.shape[-1]]


def make_pool(num_slots: int, *shape: int, dtype=torch.float32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(backing, pool): pool [num_slots, *shape] views rows of a wider random backing tensor, so dim 0 is strided
    and gap bytes surround every row."""
    row = math.prod(shape)
    backing = randn(num_slots, row + 13, gen=torch.Generator().manual_seed(seed), dtype=dtype)
    pool = backing[:, 3:3 + row].view(num_slots, *shape)
    assert not pool.is_contiguous()
    return backing, pool


def cu_seqlens_of(lens) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int64)


def compare_pools(backing: torch.Tensor, ref_backing: torch.Tensor, pool: torch.Tensor, used_slots, **kwargs) -> None:
    """Used rows close to the reference; everything else (other rows, gap bytes) bit-identical, NaN-aware."""
    backing = backing.cpu()
    mask = torch.ones_like(backing, dtype=torch.bool)
    start, size = pool.storage_offset(), pool[0].numel()
    for slot in used_slots:
        mask[slot, start:start + size] = False
        assert_close(backing[slot, start:start + size], ref_backing[slot, start:start + size],
                     what=f'state slot {slot}', **kwargs)
    torch.testing.assert_close(backing[mask], ref_backing[mask], rtol=0, atol=0, equal_nan=True)
