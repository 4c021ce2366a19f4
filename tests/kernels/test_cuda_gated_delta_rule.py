"""The CUDA backend's gated delta rule (`kernels/cuda/gated_delta_rule.py`: fla's chunked and recurrent kernels
behind the engine's state pool) against the default backend's torch reference, on the GPU: odd shapes (empty and
one-token sequences, 1/2/3-token segments after a history, grouped value heads), bf16/fp32 and strided pools,
inputs without l2norm, strided inputs, a split prefill equal to the unsplit one; the host chunk indices against
fla's. Other CUDA-backend kernels: `tests/kernels/test_cuda_kernels_ops.py`.

State pools are views into a wider backing tensor (rows strided in dim 0, gap bytes around each row); after a call
the backing tensor must equal the reference's bit for bit outside the used rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from kernel_inputs import NUM_SLOTS, SLOT_ORDER, compare_pools, cu_seqlens_of, make_pool, randn, strided_copy, tol
from numeric import assert_close

from lmdeploy.pytorch.kernels.cuda import gated_delta_rule as cuda_gdr
from lmdeploy.pytorch.kernels.default import gated_delta_rule as ref_gdr


@dataclass
class GdrCase:
    lens: tuple[int, ...]
    fresh: tuple[bool, ...]
    num_heads: int
    num_k_heads: int
    dim_k: int = 128
    dim_v: int = 128

    def __str__(self) -> str:
        return (f"L{'_'.join(map(str, self.lens))}-Hk{self.num_k_heads}-Hv{self.num_heads}"
                f'-Dk{self.dim_k}-Dv{self.dim_v}')


# fla autotunes its chunked kernels once per (key heads, value heads, Dk, Dv) and dtype, which costs most of these
# tests' time on the H200; the prefill cases share three such keys (no GVA with small heads; GVA; GVA with Dk != Dv).
GDR_PREFILL_CASES = [
    GdrCase((1,), (True,), 4, 2),
    GdrCase((1, 2, 3), (False, False, True), 4, 4, 64, 64),            # short segments after history, no GVA
    GdrCase((63, 3, 0, 64, 0), (True, False, True, False, False), 4, 2),  # empty fresh and stale segments
    GdrCase((65, 1, 130), (False, True, False), 6, 2, 128, 64),         # GVA, chunk boundaries
    GdrCase((0, 0), (True, False), 4, 2),                               # no tokens at all
]
GDR_DECODE_CASES = [
    GdrCase((1, 1, 1, 1), (False, True, False, False), 4, 2),
    GdrCase((1,), (False,), 8, 4, 128, 64),
    GdrCase((1, 1, 1), (True, True, False), 2, 2, 64, 128),
]


def gdr_inputs(case: GdrCase, dtype, seed: int = 7):
    gen = torch.Generator().manual_seed(seed)
    total, hv, hk = sum(case.lens), case.num_heads, case.num_k_heads
    q, k = randn(total, hk, case.dim_k, gen=gen), randn(total, hk, case.dim_k, gen=gen)
    v = randn(total, hv, case.dim_v, gen=gen)
    g = F.logsigmoid(randn(total, hv, gen=gen) + 2.0)
    beta = torch.sigmoid(randn(total, hv, gen=gen))
    return [x.to(dtype) for x in (q, k, v)] + [g, beta.to(dtype)]


def assert_close_rms(actual: torch.Tensor, expected: torch.Tensor, max_rms_ratio: float, what: str, **kwargs) -> None:
    """Element-wise closeness plus an RMS error ratio bound (fla's own test metric)."""
    assert_close(actual, expected, what=what, **kwargs)
    if expected.numel():
        actual, expected = actual.detach().float().cpu(), expected.detach().float().cpu()
        ratio = ((actual - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt().clamp(min=1e-12)).item()
        assert ratio <= max_rms_ratio, f'{what}: rms error ratio {ratio:.3e} > {max_rms_ratio}'


def check_gdr(kernel_name: str, case: GdrCase, dtype, pool_dtype, use_qk_l2norm: bool = True,
              strided_inputs: bool = False) -> None:
    inputs = gdr_inputs(case, dtype)
    if not use_qk_l2norm:
        inputs[0], inputs[1] = (F.normalize(x.float(), dim=-1).to(dtype) for x in inputs[:2])
    shape = (case.num_heads, case.dim_k, case.dim_v)
    backing, pool = make_pool(NUM_SLOTS, *shape, dtype=pool_dtype, seed=8)
    backing.mul_(0.1)
    slots = SLOT_ORDER[:len(case.lens)]
    for slot, fresh in zip(slots, case.fresh):
        if fresh:
            pool[slot] = float('nan')
    meta = (cu_seqlens_of(case.lens), torch.tensor(slots, dtype=torch.int64), torch.tensor(case.fresh))

    ref_backing = backing.clone()
    ref_pool = ref_backing[:, 3:3 + pool[0].numel()].view(pool.shape)
    ref = getattr(ref_gdr, kernel_name)(*inputs, meta[0], ref_pool, *meta[1:], use_qk_l2norm=use_qk_l2norm)

    dev_backing = backing.cuda()
    dev_pool = dev_backing[:, 3:3 + pool[0].numel()].view(pool.shape)
    dev_inputs = [x.cuda() for x in inputs]
    if strided_inputs:  # q/k/v as views into wider rows, as after splitting a fused projection
        dev_inputs[:3] = [strided_copy(x) for x in dev_inputs[:3]]
    out = getattr(cuda_gdr, kernel_name)(*dev_inputs, meta[0].cuda(), dev_pool, *(x.cuda() for x in meta[1:]),
                                         use_qk_l2norm=use_qk_l2norm)
    assert out.shape == ref.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    # fla runs fp32 dots in tf32 and keeps bf16 intermediates for bf16 inputs
    is_fp32 = dtype == torch.float32
    assert_close_rms(out, ref, 5e-3 if is_fp32 else 1.5e-2, 'gdr out', **tol(dtype, fp32=2e-2, bf16=1e-1))
    compare_pools(dev_backing, ref_backing, pool, slots, **tol(dtype, fp32=2e-2, bf16=1e-1))
    for slot in slots:
        assert_close_rms(dev_pool[slot], ref_pool[slot], 5e-3 if is_fp32 else 1.5e-2, f'state slot {slot}',
                         atol=1.0, rtol=1.0)


GDR_DTYPES = pytest.mark.parametrize('dtype,pool_dtype', [(torch.float32, torch.float32),
                                                          (torch.bfloat16, torch.float32),
                                                          (torch.bfloat16, torch.bfloat16)],
                                     ids=['fp32', 'bf16-fp32pool', 'bf16-bf16pool'])


@pytest.mark.gpu
@GDR_DTYPES
@pytest.mark.parametrize('case', GDR_PREFILL_CASES, ids=str)
def test_chunk_gated_delta_rule_gpu(case, dtype, pool_dtype):
    pytest.importorskip('fla')
    check_gdr('chunk_gated_delta_rule', case, dtype, pool_dtype)


@pytest.mark.gpu
@GDR_DTYPES
@pytest.mark.parametrize('case', GDR_DECODE_CASES + GDR_PREFILL_CASES[1:3], ids=str)
def test_recurrent_gated_delta_rule_gpu(case, dtype, pool_dtype):
    pytest.importorskip('fla')
    check_gdr('recurrent_gated_delta_rule', case, dtype, pool_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize('kernel_name', ['chunk_gated_delta_rule', 'recurrent_gated_delta_rule'])
def test_gated_delta_rule_without_l2norm_gpu(kernel_name):
    pytest.importorskip('fla')
    check_gdr(kernel_name, GDR_PREFILL_CASES[3], torch.float32, torch.float32, use_qk_l2norm=False)


@pytest.mark.gpu
@pytest.mark.parametrize('kernel_name', ['chunk_gated_delta_rule', 'recurrent_gated_delta_rule'])
def test_gated_delta_rule_strided_inputs_gpu(kernel_name):
    pytest.importorskip('fla')
    check_gdr(kernel_name, GDR_PREFILL_CASES[2], torch.bfloat16, torch.float32, strided_inputs=True)


@pytest.mark.gpu
def test_gated_delta_rule_split_equals_unsplit_gpu():
    """One sequence fed as prefill chunks and decode steps (the engine's pattern) equals one chunked call."""
    pytest.importorskip('fla')
    pieces = (70, 1, 1, 3, 64, 1)
    whole = GdrCase((sum(pieces),), (True,), 4, 2)
    inputs = [x.cuda() for x in gdr_inputs(whole, torch.float32, seed=9)]
    _, pool_whole = make_pool(NUM_SLOTS, 4, 128, 128)
    _, pool = make_pool(NUM_SLOTS, 4, 128, 128)
    pool_whole, pool = pool_whole.cuda(), pool.cuda()
    slot = torch.tensor([5], device='cuda')
    ref = cuda_gdr.chunk_gated_delta_rule(*inputs, cu_seqlens_of([whole.lens[0]]).cuda(), pool_whole, slot,
                                          torch.tensor([True], device='cuda'))
    outs, start = [], 0
    for i, n in enumerate(pieces):
        kernel = cuda_gdr.recurrent_gated_delta_rule if n == 1 else cuda_gdr.chunk_gated_delta_rule
        outs.append(kernel(*(x[start:start + n] for x in inputs), cu_seqlens_of([n]).cuda(), pool, slot,
                           torch.tensor([i == 0], device='cuda')))
        start += n
    assert_close_rms(torch.cat(outs), ref, 5e-3, 'split out', atol=2e-2, rtol=2e-2)
    assert_close_rms(pool[5], pool_whole[5], 5e-3, 'split state', atol=2e-2, rtol=2e-2)


def test_chunk_indices_host():
    """(sequence, chunk) per 64-token chunk, partial last chunks included, empty sequences skipped."""
    got = cuda_gdr.chunk_indices_host([65, 0, 3, 128])
    assert got.dtype == torch.int64
    assert got.tolist() == [[0, 0], [0, 1], [2, 0], [3, 0], [3, 1]]
    assert cuda_gdr.chunk_indices_host([]).shape == (0, 2)


@pytest.mark.gpu
def test_chunk_indices_host_match_fla_and_skip_its_derivation_gpu():
    """The host-built indices equal fla's own, and passing them changes no output or state."""
    pytest.importorskip('fla')
    from fla.ops.utils.index import prepare_chunk_indices
    for lens in ([1], [63, 3, 0, 64, 0], [65, 1, 130], [4096, 100, 1]):
        want = prepare_chunk_indices(cu_seqlens_of(lens).cuda(), 64)
        assert torch.equal(cuda_gdr.chunk_indices_host(lens).cuda(), want), lens
    case = GDR_PREFILL_CASES[3]
    inputs = [x.cuda() for x in gdr_inputs(case, torch.bfloat16)]
    meta = [cu_seqlens_of(case.lens).cuda(), torch.tensor(SLOT_ORDER[:len(case.lens)], device='cuda'),
            torch.tensor(case.fresh, device='cuda')]
    results = []
    for indices in (None, cuda_gdr.chunk_indices_host(list(case.lens)).cuda()):
        _, pool = make_pool(NUM_SLOTS, case.num_heads, case.dim_k, case.dim_v, seed=8)
        pool = pool.cuda()
        out = cuda_gdr.chunk_gated_delta_rule(*inputs, meta[0], pool, *meta[1:], chunk_indices=indices)
        results.append((out, pool))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])

