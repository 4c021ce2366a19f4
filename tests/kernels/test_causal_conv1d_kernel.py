"""The CUDA backend's causal depthwise conv1d (`kernels/cuda/causal_conv1d.py`) against the torch reference of the
default backend (`kernels/default/causal_conv1d.py`): outputs and the conv history pool, the q / k / v planes form,
a prompt split into segments against the whole, each at the defaults (the token-parallel kernel's vector stores and
its history split off to the per-sequence kernel) and with either turned off (`LMDEPLOY_CONV_VECTOR_STORES=0`,
`LMDEPLOY_CONV_SPLIT_HISTORY=0`).

`@pytest.mark.gpu` tests run on CUDA (the reference on CPU); `test_cpu_*` run the Triton kernels on CPU tensors
under the Triton interpreter, inside the subprocess `test_conv_kernels_interpreted` starts (TRITON_INTERPRET must
be set before Triton is imported). The pool is a view into a wider backing tensor (rows strided in dim 0, gap bytes
around each row); after a call the backing tensor must equal the reference's bit for bit outside the used rows.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from interpreted import run_cpu_tests_interpreted
from kernel_inputs import DTYPES, NUM_SLOTS, SLOT_ORDER, compare_pools, cu_seqlens_of, make_pool, randn, tol
from numeric import assert_close

from lmdeploy.pytorch.kernels.cuda import causal_conv1d as cuda_conv
from lmdeploy.pytorch.kernels.default import causal_conv1d as ref_conv

INTERPRET = os.environ.get('TRITON_INTERPRET') == '1'
interpreted = pytest.mark.skipif(not INTERPRET, reason='runs inside test_conv_kernels_interpreted')


@dataclass
class ConvCase:
    lens: tuple[int, ...]
    fresh: tuple[bool, ...]
    width: int
    channels: int
    with_bias: bool = True

    def __str__(self) -> str:
        bias = '' if self.with_bias else '-nobias'
        return f"L{'_'.join(map(str, self.lens))}-K{self.width}-C{self.channels}{bias}"


CONV_CASES = [
    ConvCase((1, 1, 1, 1), (False, True, False, False), 4, 6),          # decode step
    ConvCase((1,), (True,), 4, 3),                                      # single fresh token
    ConvCase((0, 2, 1), (False, False, True), 4, 5),                    # T == B but not all ones
    ConvCase((5, 1, 2, 3, 0, 9), (True, False, False, False, False, True), 4, 6),  # 1/2/3 after history
    ConvCase((0, 0), (False, True), 4, 3),                              # no tokens at all
    ConvCase((17, 2), (False, True), 2, 33, False),
    ConvCase((4, 3, 40), (True, False, False), 3, 130),
    ConvCase((2, 3, 1, 1, 70), (False, False, True, False, False), 4, 300),
    ConvCase((5, 3, 40), (True, False, False), 4, 256),   # channels and q / k / v bounds multiples of 8
]
# model-sized channel counts (Qwen3.5-like conv dim), GPU only
CONV_CASES_LARGE = [ConvCase((1,) * 8, (False, True) * 4, 4, 8192),
                    ConvCase((37, 1, 200), (False, True, False), 4, 8192),
                    ConvCase((600, 1, 700), (True, False, False), 4, 8192)]   # the wide tiles (>= 512 tokens)


def check_conv(case: ConvCase, dtype, activation, device: str) -> None:
    gen = torch.Generator().manual_seed(3)
    weight = randn(case.channels, case.width, gen=gen, dtype=dtype)
    bias = randn(case.channels, gen=gen, dtype=dtype) if case.with_bias else None
    x = randn(sum(case.lens), case.channels, gen=gen, dtype=dtype)
    backing, pool = make_pool(NUM_SLOTS, case.channels, case.width - 1, dtype=dtype, seed=4)
    slots = SLOT_ORDER[:len(case.lens)]
    for slot, fresh in zip(slots, case.fresh):
        if fresh:
            pool[slot] = float('nan')  # a fresh sequence must never read its slot
    state_ids, is_fresh = torch.tensor(slots, dtype=torch.int64), torch.tensor(case.fresh)
    cu_seqlens = cu_seqlens_of(case.lens)

    ref_backing = backing.clone()
    ref_pool = ref_backing[:, 3:3 + pool[0].numel()].view(pool.shape)
    ref = ref_conv.causal_conv1d(x, weight, bias, ref_pool, state_ids, is_fresh, cu_seqlens, activation)

    start_backing = backing.clone()  # on the CPU `.to(device)` is the same tensor, which the call updates
    dev_backing = backing.to(device)
    dev_pool = dev_backing[:, 3:3 + pool[0].numel()].view(pool.shape)
    def to(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    out = cuda_conv.causal_conv1d(to(x), to(weight), to(bias), dev_pool, to(state_ids), to(is_fresh),
                                  to(cu_seqlens), activation)
    assert out.shape == ref.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    assert_close(out, ref, what='conv out', **tol(dtype, fp32=1e-5))
    compare_pools(dev_backing, ref_backing, pool, slots, atol=0, rtol=0)  # states are copies of inputs
    check_conv_planes(case, x, weight, bias, start_backing, pool, state_ids, is_fresh, cu_seqlens, activation, out,
                      dev_backing, device)


def check_conv_planes(case: ConvCase, x, weight, bias, backing, pool, state_ids, is_fresh, cu_seqlens, activation,
                      out, want_backing, device: str) -> None:
    """`causal_conv1d_planes` in three groups (q / k / v-like thirds) and in four of uneven widths (bounds inside
    the kernel's channel blocks, a one-channel group first), and for a channel count that is a multiple of 32 in the
    models' q / k / v quarters (the aligned stores; with 256 channels one block spans two planes, the other lies in
    one): each group is a contiguous tensor holding exactly the plain output's columns, and the pool ends as after
    the plain call."""
    third, quarter = case.channels // 3, case.channels // 4
    all_splits = [(third, third, case.channels - 2 * third), (1, quarter, case.channels - 1 - 2 * quarter, quarter)]
    if case.channels % 32 == 0:
        all_splits.append((quarter, quarter, case.channels - 2 * quarter))
    for splits in all_splits:
        plane_backing = backing.to(device, copy=True)  # on the CPU `.to` alone would share (and update) it
        plane_pool = plane_backing[:, 3:3 + pool[0].numel()].view(pool.shape)
        planes = cuda_conv.causal_conv1d_planes(x.to(device), weight.to(device),
                                                None if bias is None else bias.to(device), plane_pool,
                                                state_ids.to(device), is_fresh.to(device), cu_seqlens.to(device),
                                                splits, activation)
        assert len(planes) == len(splits)
        for plane, want in zip(planes, out.split(splits, dim=-1)):
            assert plane.is_contiguous() and plane.shape == want.shape
            torch.testing.assert_close(plane, want, rtol=0, atol=0)
        torch.testing.assert_close(plane_backing, want_backing, rtol=0, atol=0, equal_nan=True)


def test_causal_conv1d_planes_rejects_bad_splits():
    """More than four groups, or groups that do not sum to the channels, are a clear error before any launch."""
    x, weight, pool = torch.zeros(2, 10), torch.zeros(10, 4), torch.zeros(1, 10, 3)
    args = (x, weight, None, pool, torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.bool),
            torch.tensor([0, 2]))
    with pytest.raises(ValueError, match='1 to 4 groups'):
        cuda_conv.causal_conv1d_planes(*args, (2, 2, 2, 2, 2))
    with pytest.raises(ValueError, match='sum to 10'):
        cuda_conv.causal_conv1d_planes(*args, (4, 4))


@pytest.mark.gpu
@DTYPES
@pytest.mark.parametrize('activation', ['silu', None], ids=['silu', 'noact'])
@pytest.mark.parametrize('case', CONV_CASES + CONV_CASES_LARGE, ids=str)
def test_causal_conv1d_gpu(case, activation, dtype):
    check_conv(case, dtype, activation, 'cuda')


def check_conv_split(device: str) -> None:
    """Feeding one sequence as 1/2/3-token pieces (prefill then decode-sized steps) equals one call."""
    channels, width, pieces = 40, 4, (5, 1, 2, 3, 1, 1, 7)
    gen = torch.Generator().manual_seed(5)
    weight, bias = randn(channels, width, gen=gen).to(device), randn(channels, gen=gen).to(device)
    x = randn(sum(pieces), channels, gen=gen).to(device)
    pool_whole, pool = (make_pool(NUM_SLOTS, channels, width - 1)[1].to(device) for _ in range(2))
    slot = torch.tensor([2], device=device)
    whole = cuda_conv.causal_conv1d(x, weight, bias, pool_whole, slot, torch.tensor([True], device=device),
                                    cu_seqlens_of([len(x)]).to(device))
    outs, start = [], 0
    for i, n in enumerate(pieces):
        outs.append(cuda_conv.causal_conv1d(x[start:start + n], weight, bias, pool, slot,
                                            torch.tensor([i == 0], device=device), cu_seqlens_of([n]).to(device)))
        start += n
    assert_close(torch.cat(outs), whole, atol=1e-5, rtol=1e-5, what='split conv')
    torch.testing.assert_close(pool[2], pool_whole[2], rtol=0, atol=0)


@pytest.mark.gpu
def test_causal_conv1d_split_equals_unsplit_gpu():
    check_conv_split('cuda')


@interpreted
def test_cpu_causal_conv1d_split_equals_unsplit():
    check_conv_split('cpu')


@interpreted
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16], ids=['fp32', 'bf16'])
@pytest.mark.parametrize('case', CONV_CASES, ids=str)
def test_cpu_causal_conv1d(case, dtype):
    check_conv(case, dtype, 'silu' if case.with_bias else None, 'cpu')


# channels and plane bounds multiples of 8: the stores through one plane's row stride (the default), and the
# per-column plane layout everywhere (LMDEPLOY_CONV_VECTOR_STORES=0)
VECTOR_STORE_CASES = [c for c in CONV_CASES + CONV_CASES_LARGE if c.channels % 32 == 0]


@interpreted
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16], ids=['fp32', 'bf16'])
@pytest.mark.parametrize('vector', [True, False], ids=['vector', 'plane'])
def test_cpu_causal_conv1d_store_forms(monkeypatch, dtype, vector):
    monkeypatch.setattr(cuda_conv, 'VECTOR_STORES', vector)
    check_conv(VECTOR_STORE_CASES[0], dtype, 'silu', 'cpu')


@pytest.mark.gpu
@pytest.mark.parametrize('case', VECTOR_STORE_CASES, ids=str)
@pytest.mark.parametrize('vector', [True, False], ids=['vector', 'plane'])
def test_causal_conv1d_store_forms_gpu(monkeypatch, case, vector):
    monkeypatch.setattr(cuda_conv, 'VECTOR_STORES', vector)
    check_conv(case, torch.bfloat16, 'silu', 'cuda')


def test_token_tiles_widen_from_512_tokens():
    assert cuda_conv.TOKEN_TILES is None or os.environ.get('LMDEPLOY_CONV_TILES')
    if cuda_conv.TOKEN_TILES is None:
        assert cuda_conv.token_tiles(8192, 100) == cuda_conv.token_tiles(8192, 511) == (8, 64, 2)
        assert cuda_conv.token_tiles(8192, 512) == cuda_conv.token_tiles(8192, 32768) == (8, 128, 2)
        assert cuda_conv.token_tiles(6, 4096) == (8, 8, 2) and cuda_conv.token_tiles(100, 1024) == (8, 128, 2)


# the wide tiles on the interpreter's small cases (their prompts are short: the threshold lowered)
@interpreted
@pytest.mark.parametrize('case', [c for c in CONV_CASES if c.channels > 64], ids=str)
def test_cpu_causal_conv1d_wide_tiles(monkeypatch, case):
    monkeypatch.setattr(cuda_conv, 'WIDE_TILE_TOKENS', 2)
    check_conv(case, torch.bfloat16, 'silu' if case.with_bias else None, 'cpu')


# the history read by the token-parallel kernel itself (LMDEPLOY_CONV_SPLIT_HISTORY=0), at the earlier tiles
@interpreted
@pytest.mark.parametrize('case', CONV_CASES, ids=str)
def test_cpu_causal_conv1d_history_in_token_kernel(monkeypatch, case):
    monkeypatch.setattr(cuda_conv, 'SPLIT_HISTORY', False)
    monkeypatch.setattr(cuda_conv, 'TOKEN_TILES', (16, 128, 4))
    check_conv(case, torch.bfloat16, 'silu' if case.with_bias else None, 'cpu')


@pytest.mark.gpu
@pytest.mark.parametrize('case', CONV_CASES + CONV_CASES_LARGE, ids=str)
def test_causal_conv1d_history_in_token_kernel_gpu(monkeypatch, case):
    monkeypatch.setattr(cuda_conv, 'SPLIT_HISTORY', False)
    check_conv(case, torch.bfloat16, 'silu', 'cuda')


@pytest.mark.skipif(INTERPRET, reason='already running under the interpreter')
def test_conv_kernels_interpreted():
    """Run the `test_cpu_*` tests in a subprocess with TRITON_INTERPRET=1 (set before Triton is imported)."""
    run_cpu_tests_interpreted(__file__)
