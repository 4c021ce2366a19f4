"""Fused small ops of the `cuda` backend against the unfused torch path of the `default` backend, and the cheap
Triton launcher (`kernels/cuda/launch.py`).

* residual add + RMSNorm (`add_rms_norm`): the new residual must be bit-identical to torch's `x + residual`;
* MoE router tail (`softmax_topk`): chosen experts must carry the reference's probabilities rank by rank (ties
  may pick another expert of equal probability), weights within tolerance;
* rotary + KV fill (`rotary_fill_kv_cache`): q as `apply_rotary`, the pool as `apply_rotary` + `fill_kv_cache`
  (strided packed pool, a negative padding slot that must write nothing, partial rotary).
`@pytest.mark.gpu` tests run the kernels on CUDA; `test_cpu_*` run them on CPU tensors under the Triton interpreter
inside the subprocess `test_fused_kernels_interpreted` starts (TRITON_INTERPRET must be set before Triton loads).
"""
from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl
from interpreted import run_cpu_tests_interpreted
from kernel_inputs import DTYPES, randn, strided_copy, tol
from numeric import assert_close

from lmdeploy.pytorch.backends.default import elementwise as ref_elementwise
from lmdeploy.pytorch.backends.default import moe as ref_moe
from lmdeploy.pytorch.kernels.cuda import causal_conv1d as cuda_conv
from lmdeploy.pytorch.kernels.cuda import gated_delta_gating as cuda_gating
from lmdeploy.pytorch.kernels.cuda import moe_align as cuda_align
from lmdeploy.pytorch.kernels.cuda import moe_routing as cuda_routing
from lmdeploy.pytorch.kernels.cuda import rms_norm as cuda_norm
from lmdeploy.pytorch.kernels.cuda import rms_norm_rows as cuda_norm_rows
from lmdeploy.pytorch.kernels.cuda import rotary as cuda_rotary
from lmdeploy.pytorch.kernels.cuda.launch import FastKernel, arg_key, fast_kernel, wait_for_inputs
from lmdeploy.pytorch.kernels.default import paged_attention as ref_attn
from lmdeploy.pytorch.nn.attention import QKNorm

INTERPRET = os.environ.get('TRITON_INTERPRET') == '1'
interpreted = pytest.mark.skipif(not INTERPRET, reason='runs inside test_fused_kernels_interpreted')

# ----------------------------------------------------------------------------------------- residual add + norm

ADD_NORM_SHAPES = [(1, 7), (5, 33), (3, 4, 128), (0, 16), (4, 2048)]


def check_add_rms_norm(shape, dtype, zero_centered: bool, is_strided: bool, device: str, norm=cuda_norm) -> None:
    gen = torch.Generator().manual_seed(3)
    x, res = randn(*shape, gen=gen, dtype=dtype), randn(*shape, gen=gen, dtype=dtype)
    weight = randn(shape[-1], gen=gen, dtype=dtype)
    ref_out, ref_res = ref_elementwise.add_rms_norm(x, res, weight, 1e-6, zero_centered)
    x_dev, res_dev = x.to(device), res.to(device)
    if is_strided:
        x_dev, res_dev = strided_copy(x_dev, pad=3), strided_copy(res_dev, pad=5)
    out, new_res = norm.add_rms_norm(x_dev, res_dev, weight.to(device), 1e-6, zero_centered)
    assert out.dtype == new_res.dtype == dtype and out.shape == new_res.shape == x.shape
    # The residual stream is exact: the compiled kernel rounds to nearest even like torch. Triton's interpreter
    # truncates float32 -> bf16 casts, so on the CPU bf16 sums may differ by one unit in the last place.
    exact = device != 'cpu' or dtype == torch.float32
    torch.testing.assert_close(new_res.cpu(), ref_res, rtol=0 if exact else 8e-3, atol=0)
    assert_close(out, ref_out, what='add_rms_norm', **tol(dtype))


# the kernel of LMDEPLOY_FUSED_PREFILL=0 and the default one (`rms_norm_rows.py`)
NORM_MODULES = pytest.mark.parametrize('norm', [cuda_norm, cuda_norm_rows], ids=['rms_norm', 'rms_norm_rows'])


@pytest.mark.gpu
@NORM_MODULES
@DTYPES
@pytest.mark.parametrize('zero_centered', [False, True], ids=['plain', 'zero_centered'])
@pytest.mark.parametrize('is_strided', [False, True], ids=['contiguous', 'strided'])
@pytest.mark.parametrize('shape', ADD_NORM_SHAPES, ids=lambda s: 'x'.join(map(str, s)))
def test_add_rms_norm_matches_unfused_gpu(shape, is_strided, zero_centered, dtype, norm):
    check_add_rms_norm(shape, dtype, zero_centered, is_strided, 'cuda', norm)


@interpreted
@NORM_MODULES
@DTYPES
@pytest.mark.parametrize('shape', ADD_NORM_SHAPES[:4], ids=lambda s: 'x'.join(map(str, s)))
def test_cpu_add_rms_norm(shape, dtype, norm):
    check_add_rms_norm(shape, dtype, zero_centered=shape[0] % 2 == 1, is_strided=shape[0] % 2 == 0, device='cpu',
                       norm=norm)


# ---------------------------------------------------------------------------------------------- MoE routing

ROUTING_CASES = [(1, 8, 2), (9, 64, 10), (5, 7, 3), (0, 16, 4), (33, 128, 8), (4, 512, 10)]


def check_nan_rows_keep_ids_valid(device: str) -> None:
    """A NaN row (a CUDA graph's garbage padding row) still yields k distinct ids in [0, E), as torch.topk does:
    the MoE alignment indexes buffers with them."""
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    logits[1] = float('nan')
    logits[2, :5] = float('nan')
    _, ids = cuda_routing.softmax_topk(logits.to(device), 10, True)
    ids = ids.cpu()
    assert bool(((ids >= 0) & (ids < 64)).all()) and all(len(set(r)) == 10 for r in ids.tolist()), ids


@pytest.mark.gpu
def test_softmax_topk_keeps_ids_valid_on_nan_rows_gpu():
    check_nan_rows_keep_ids_valid('cuda')


@interpreted
def test_cpu_softmax_topk_nan_rows():
    check_nan_rows_keep_ids_valid('cpu')


def check_softmax_topk(case, dtype, renormalize: bool, device: str) -> None:
    num_tokens, num_experts, top_k = case
    logits = randn(num_tokens, num_experts, gen=torch.Generator().manual_seed(num_experts), dtype=dtype) * 3
    ref_w, ref_ids = ref_moe.softmax_topk(logits, top_k, renormalize)
    weights, ids = cuda_routing.softmax_topk(logits.to(device), top_k, renormalize)
    assert weights.dtype == dtype and ids.dtype == torch.int64 and ids.shape == ref_ids.shape
    weights, ids = weights.cpu(), ids.cpu()
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    # Each rank's chosen expert carries the reference's probability at that rank (an exact tie may pick the other).
    torch.testing.assert_close(probs.gather(1, ids), probs.gather(1, ref_ids), rtol=0, atol=0)
    assert all(len(set(row)) == top_k for row in ids.tolist()), 'an expert was chosen twice'
    assert_close(weights, ref_w, what='softmax_topk weights', **tol(dtype))


@pytest.mark.gpu
@DTYPES
@pytest.mark.parametrize('renormalize', [True, False], ids=['renorm', 'raw'])
@pytest.mark.parametrize('case', ROUTING_CASES, ids=lambda c: f'T{c[0]}-E{c[1]}-k{c[2]}')
def test_softmax_topk_matches_torch_router_gpu(case, renormalize, dtype):
    check_softmax_topk(case, dtype, renormalize, 'cuda')


def check_softmax_topk_shared(case, dtype, device: str) -> None:
    """With a shared expert's gate logits: the routed columns as without, then id E and torch.sigmoid(logit)."""
    num_tokens, num_experts, top_k = case
    gen = torch.Generator().manual_seed(num_tokens + 5)
    logits = randn(num_tokens, num_experts, gen=gen, dtype=dtype) * 3
    gate = randn(num_tokens, 1, gen=gen, dtype=dtype) * 4
    ref_w, ref_ids = ref_moe.softmax_topk(logits, top_k, True, gate)
    plain_w, plain_ids = cuda_routing.softmax_topk(logits.to(device), top_k, True)
    weights, ids = cuda_routing.softmax_topk(logits.to(device), top_k, True, gate.to(device))
    assert weights.shape == ids.shape == (num_tokens, top_k + 1) == ref_ids.shape
    torch.testing.assert_close(ids[:, :top_k].cpu(), plain_ids.cpu(), rtol=0, atol=0)
    torch.testing.assert_close(weights[:, :top_k].cpu(), plain_w.cpu(), rtol=0, atol=0)
    assert bool((ids[:, -1].cpu() == num_experts).all()) and bool((ref_ids[:, -1] == num_experts).all())
    assert_close(weights[:, -1:].cpu(), torch.sigmoid(gate), what='shared scale', **tol(dtype))


@pytest.mark.gpu
@DTYPES
@pytest.mark.parametrize('case', ROUTING_CASES, ids=lambda c: f'T{c[0]}-E{c[1]}-k{c[2]}')
def test_softmax_topk_shared_column_gpu(case, dtype):
    check_softmax_topk_shared(case, dtype, 'cuda')


@interpreted
@DTYPES
@pytest.mark.parametrize('case', ROUTING_CASES[:4], ids=lambda c: f'T{c[0]}-E{c[1]}-k{c[2]}')
def test_cpu_softmax_topk(case, dtype):
    check_softmax_topk(case, dtype, renormalize=case[0] % 2 == 1, device='cpu')


@interpreted
@DTYPES
@pytest.mark.parametrize('case', ROUTING_CASES[:4], ids=lambda c: f'T{c[0]}-E{c[1]}-k{c[2]}')
def test_cpu_softmax_topk_shared_column(case, dtype):
    check_softmax_topk_shared(case, dtype, 'cpu')


# ------------------------------------------------------------------------------------------ rotary + KV fill

# (tokens, q heads, kv heads, head_dim, rotary_dim, kernel block size)
ROTARY_FILL_CASES = [(1, 2, 1, 16, 16, 4), (7, 4, 2, 32, 8, 4), (0, 2, 1, 16, 16, 4), (37, 16, 2, 256, 64, 16)]


def check_rotary_fill(case, dtype, device: str, norm: str = 'none') -> None:
    """`norm`: 'none', 'plain' or 'zero_centered' q/k RMSNorm before the rotary (`QKNorm`)."""
    num_tokens, num_q, num_kv, head_dim, rotary_dim, kbs = case
    gen = torch.Generator().manual_seed(num_tokens + head_dim)
    # q and k are views of one fused projection output, as in the models (non-contiguous heads).
    qkv = randn(num_tokens, (num_q + 2 * num_kv) * head_dim, gen=gen, dtype=dtype)
    q, k, v = (t.unflatten(-1, (-1, head_dim)) for t in qkv.split([num_q * head_dim, num_kv * head_dim,
                                                                       num_kv * head_dim], dim=-1))
    angles = randn(num_tokens, rotary_dim // 2, gen=gen) * 3
    cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
    num_pages = max(2, -(-num_tokens // kbs) + 1)
    # packed pool: one page row holds a K page then a V page, so the page stride is 2 * kbs * H * D
    pool = randn(num_pages, 2, kbs, num_kv, head_dim, gen=gen, dtype=dtype)
    slots = torch.randperm(num_pages * kbs, generator=gen)[:num_tokens]
    if num_tokens > 1:
        slots[1] = -1  # a padding row of a captured graph: writes nothing
    qk_norm = None
    ref_qn, ref_kn = q, k
    if norm != 'none':
        qk_norm = QKNorm(randn(head_dim, gen=gen, dtype=dtype), randn(head_dim, gen=gen, dtype=dtype), 1e-6,
                         norm == 'zero_centered')
        ref_qn = ref_elementwise.rms_norm(q, qk_norm.q_weight, 1e-6, qk_norm.zero_centered)
        ref_kn = ref_elementwise.rms_norm(k, qk_norm.k_weight, 1e-6, qk_norm.zero_centered)
    ref_q, ref_k = ref_elementwise.apply_rotary(ref_qn, ref_kn, cos, sin)
    ref_pool = pool.clone()
    keep = slots >= 0
    ref_attn.fill_kv_cache(ref_k[keep], v[keep], ref_pool[:, 0], ref_pool[:, 1], slots[keep])
    dev_pool = pool.to(device)
    q_out = cuda_rotary.rotary_fill_kv_cache(q.to(device), k.to(device), v.to(device), cos.to(device),
                                             sin.to(device), dev_pool[:, 0], dev_pool[:, 1], slots.to(device),
                                             qk_norm=None if qk_norm is None else
                                             QKNorm(qk_norm.q_weight.to(device), qk_norm.k_weight.to(device),
                                                    1e-6, qk_norm.zero_centered))
    assert q_out.shape == q.shape and q_out.dtype == dtype
    assert_close(q_out, ref_q, what='rotated q', **tol(dtype))
    # K is rotated in float32 and rounded like the unfused kernels; V and untouched rows are copied bit for bit.
    assert_close(dev_pool[:, 0], ref_pool[:, 0], what='K pool', **tol(dtype))
    torch.testing.assert_close(dev_pool[:, 1].cpu(), ref_pool[:, 1], rtol=0, atol=0)
    untouched = torch.ones(num_pages * kbs, dtype=torch.bool)
    untouched[slots[keep]] = False
    torch.testing.assert_close(dev_pool[:, 0].flatten(0, 1)[untouched].cpu(),
                               pool[:, 0].flatten(0, 1)[untouched], rtol=0, atol=0)


@pytest.mark.gpu
@DTYPES
@pytest.mark.parametrize('norm', ['none', 'plain', 'zero_centered'])
@pytest.mark.parametrize('case', ROTARY_FILL_CASES, ids=lambda c: 'T{}-Hq{}-Hk{}-D{}-R{}-kbs{}'.format(*c))
def test_rotary_fill_kv_cache_matches_unfused_gpu(case, norm, dtype):
    check_rotary_fill(case, dtype, 'cuda', norm)


@interpreted
@DTYPES
@pytest.mark.parametrize('case', ROTARY_FILL_CASES[:3], ids=lambda c: 'T{}-Hq{}-Hk{}-D{}-R{}-kbs{}'.format(*c))
def test_cpu_rotary_fill_kv_cache(case, dtype):
    check_rotary_fill(case, dtype, 'cpu', ['none', 'plain', 'zero_centered'][case[0] % 3])
    if case[0] == 7:
        check_rotary_fill(case, dtype, 'cpu', 'zero_centered')


# ------------------------------------------------------------------------------------------- MoE alignment

# (tokens, top_k, experts, BLOCK_M)
# (each case in every form that takes it: the one-launch form up to moe_align.ONE_LAUNCH_PAIRS pairs, 256 x 8 = 2048
# the most, over two of its 1024-pair steps; the two- and three-launch forms at every count, the two-launch one over
# several programs from 1025 pairs: 700 x 8 on 6, 300 x 8 on 3, and 1200 x 10 on 12, whose 128 experts' runs of
# BLOCK_M 128 give the blocks more rows than a program's share of them)
ALIGN_CASES = [(1, 2, 8, 16), (3, 4, 64, 16), (0, 2, 8, 16), (40, 10, 64, 32), (700, 8, 128, 64), (5, 3, 7, 16),
               (256, 8, 65, 16), (300, 8, 65, 16), (130, 8, 512, 16), (1200, 10, 128, 128)]


def check_align(case, device: str, form: str | None = None, num_warps: int | None = None) -> None:
    num_tokens, top_k, num_experts, block_m = case
    gen = torch.Generator().manual_seed(num_tokens + num_experts)
    # skewed routing (half the pairs on experts 0-2) so some experts get several blocks and some none
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]) \
        if num_tokens else torch.zeros(0, top_k, dtype=torch.int64)
    if num_tokens > 1:
        ids[::2, 0] = torch.randint(0, 3, (ids[::2].shape[0],), generator=gen)
        ids[::2] = torch.stack([row if len(set(row.tolist())) == top_k else torch.arange(top_k) for row in ids[::2]])
    ref_pairs, ref_blocks = cuda_align.align_pairs_reference(ids, num_experts, block_m)
    pairs, blocks = cuda_align.align_pairs(ids.to(device), num_experts, block_m, form=form, num_warps=num_warps)
    pairs, blocks = pairs.cpu(), blocks.cpu()
    assert pairs.shape == ref_pairs.shape and blocks.shape == ref_blocks.shape
    if num_tokens == 0:
        return
    torch.testing.assert_close(blocks, ref_blocks, rtol=0, atol=0)
    # The same rows hold pairs (the rest the sentinel), each such row holds a pair of the same expert as the
    # reference's row, and every pair appears once: the order inside an expert's run is free.
    num_pairs = ids.numel()
    used = ref_pairs < num_pairs
    assert torch.equal(pairs < num_pairs, used) and bool((pairs[~used] == num_pairs).all())
    flat = ids.reshape(-1)
    torch.testing.assert_close(flat[pairs[used]], flat[ref_pairs[used]], rtol=0, atol=0)
    assert sorted(pairs[used].tolist()) == list(range(num_pairs))


@pytest.mark.gpu
@pytest.mark.parametrize('case', ALIGN_CASES, ids=lambda c: 'T{}-k{}-E{}-M{}'.format(*c))
def test_moe_align_matches_torch_grouping_gpu(case):
    check_align(case, 'cuda', form='three')
    check_align(case, 'cuda', form='two')
    if case[0] * case[1] <= cuda_align.ONE_LAUNCH_PAIRS:
        for warps in (4, 8, 16):  # the one program's placement does not depend on its width
            check_align(case, 'cuda', form='one', num_warps=warps)


@interpreted
@pytest.mark.parametrize('case', ALIGN_CASES[:4] + ALIGN_CASES[5:], ids=lambda c: 'T{}-k{}-E{}-M{}'.format(*c))
def test_cpu_moe_align(case):
    pairs = case[0] * case[1]
    if pairs <= 64 or pairs > cuda_align.ONE_LAUNCH_PAIRS:
        check_align(case, 'cpu', form='three')
    if pairs <= 64 or pairs > 1024:  # one program of the two-launch form below, several above
        check_align(case, 'cpu', form='two')
    if pairs <= cuda_align.ONE_LAUNCH_PAIRS:
        check_align(case, 'cpu', form='one')


# -------------------------------------------------------------------------------------- gated delta gating

GATING_CASES = [(1, 4), (7, 32), (0, 8), (65, 48)]


def check_gating(case, dtype, device: str) -> None:
    num_tokens, num_heads = case
    gen = torch.Generator().manual_seed(num_heads)
    ba = randn(num_tokens, 2 * num_heads, gen=gen, dtype=dtype) * 4  # one fused projection: [b, a], strided views
    b, a = ba.split(num_heads, dim=-1)
    if num_tokens > 2:  # softplus's regimes: far below zero, near zero, past the threshold of 20
        a[0], a[1], a[2] = -30.0, 1e-3, 25.0
    A_log, dt_bias = randn(num_heads, gen=gen, dtype=dtype), randn(num_heads, gen=gen, dtype=dtype)
    ref_g, ref_beta = ref_elementwise.gated_delta_gating(a, b, A_log, dt_bias)
    g, beta = cuda_gating.gated_delta_gating(*(t.to(device) for t in (a, b, A_log, dt_bias)))
    assert g.dtype == torch.float32 and beta.dtype == dtype and g.shape == beta.shape == a.shape
    assert_close(g, ref_g, what='g', atol=1e-6, rtol=1e-5)
    assert_close(beta, ref_beta, what='beta', **tol(dtype))


@pytest.mark.gpu
@DTYPES
@pytest.mark.parametrize('case', GATING_CASES, ids=lambda c: f'T{c[0]}-H{c[1]}')
def test_gated_delta_gating_matches_torch_gpu(case, dtype):
    check_gating(case, dtype, 'cuda')


@interpreted
@DTYPES
@pytest.mark.parametrize('case', GATING_CASES[:3], ids=lambda c: f'T{c[0]}-H{c[1]}')
def test_cpu_gated_delta_gating(case, dtype):
    check_gating(case, dtype, 'cpu')


# ------------------------------------------------------------------------- conv with per-forward indices

def check_conv_with_shared_indices(device: str) -> None:
    """The conv kernel given the per-forward index tensors (built once for every layer) equals its own build."""
    gen = torch.Generator().manual_seed(7)
    lens, channels, kernel = [5, 1, 9], 24, 4
    cu = torch.tensor([0, 5, 6, 15], device=device)
    x = randn(sum(lens), channels, gen=gen).to(device)
    weight, pool = randn(channels, kernel, gen=gen).to(device), randn(4, channels, kernel - 1, gen=gen).to(device)
    ids, fresh = torch.tensor([2, 0, 3], device=device), torch.tensor([False, True, False], device=device)
    pool_a, pool_b = pool.clone(), pool.clone()
    want = cuda_conv.causal_conv1d(x, weight, None, pool_a, ids, fresh, cu)
    got = cuda_conv.causal_conv1d(x, weight, None, pool_b, ids, fresh, cu, fresh_u8=fresh.to(torch.uint8),
                                  seq_of_token=cuda_conv.seq_of_token_of(cu, x.shape[0]))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(pool_b, pool_a, rtol=0, atol=0)


def test_conv_fresh_flags_are_a_view_when_they_can_be():
    """A contiguous bool tensor on the kernel's device is read in place (no launch per layer in a decode graph);
    anything else is copied to one byte a sequence."""
    flags = torch.tensor([True, False, True])
    view = cuda_conv.fresh_flags(flags, flags.device)
    assert view.dtype == torch.uint8 and view.data_ptr() == flags.data_ptr() and view.tolist() == [1, 0, 1]
    strided = torch.tensor([True, True, False, False, True, False])[::2]
    copied = cuda_conv.fresh_flags(strided, strided.device)
    assert copied.is_contiguous() and copied.data_ptr() != strided.data_ptr() and copied.tolist() == [1, 0, 1]
    ints = cuda_conv.fresh_flags(torch.tensor([0, 3]), flags.device)
    assert ints.dtype == torch.uint8 and (ints != 0).tolist() == [False, True]


@pytest.mark.gpu
def test_conv_with_shared_indices_gpu():
    check_conv_with_shared_indices('cuda')


@interpreted
def test_cpu_conv_with_shared_indices():
    check_conv_with_shared_indices('cpu')


# ------------------------------------------------------------------------------------------- fast launcher

def test_launch_key_separates_every_triton_specialization():
    """Values Triton compiles apart (int == 1, int % 16, int width, pointer alignment, dtype) never share a key."""
    base = torch.zeros(64)
    assert arg_key(base) != arg_key(base[1:])  # 16-byte aligned vs not
    assert arg_key(base) != arg_key(base.to(torch.bfloat16))
    assert arg_key(base[4:]) == arg_key(base)  # 16 bytes in: still aligned
    keys = {arg_key(n) for n in (1, 2, 16, 2 ** 31, 2 ** 63)}
    assert len(keys) == 5
    assert arg_key(17) == arg_key(3) and arg_key(32) == arg_key(48)
    assert arg_key(1.0) != arg_key(1) and arg_key(None) != arg_key(True)
    # a do_not_specialize int: only its width class (Triton compiles one binary for 1, 16 and 17)
    assert arg_key(1, False) == arg_key(16, False) == arg_key(17, False) != arg_key(2 ** 31, False)


@fast_kernel
@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, alpha * x + y, mask=mask)


@fast_kernel
@triton.jit(do_not_specialize=['n'])
def _axpy_any_n_kernel(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, alpha * tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)


@pytest.mark.gpu
def test_fast_launch_reuses_compiled_handle_and_respecializes_gpu():
    kernel: FastKernel = _axpy_kernel
    assert kernel.is_fast
    base = torch.randn(4096, device='cuda')
    y = torch.randn(4096, device='cuda')
    cases = [(4096, 0), (4096, 0), (1, 0), (17, 0), (4095, 1), (4096, 0), (33, 3), (16, 0)]
    for n, offset in cases:
        x = base[offset:offset + n]
        out = torch.empty(n, device='cuda')
        kernel[(triton.cdiv(n, 128),)](x, y[:n], out, n, 0.5, BLOCK=128)
        torch.testing.assert_close(out, 0.5 * x + y[:n])
    # (n % 16 == 0, aligned), (n == 1), (n odd), (misaligned x, n odd): four specializations, each compiled once
    assert kernel.num_compiled == 4
    unspecialized: FastKernel = _axpy_any_n_kernel
    for n in (4096, 1, 17, 16):
        out = torch.empty(n, device='cuda')
        unspecialized[(triton.cdiv(n, 128),)](base[:n], y[:n], out, n, 0.5, BLOCK=128)
        torch.testing.assert_close(out, 0.5 * base[:n] + y[:n])
    assert unspecialized.num_compiled == 1   # `n` is not specialized: one binary for every n


@fast_kernel
@triton.jit
def _reverse_add_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    # each program reads what other programs of the previous launch wrote (a missed wait reads stale values)
    tl.store(out_ptr + offs, tl.load(x_ptr + n - 1 - offs, mask=mask) + 1.0, mask=mask)


@pytest.mark.gpu
def test_pdl_chain_keeps_stream_order_gpu():
    """A chain of launches, each reading its predecessor's output across programs and overwriting what that one
    read, gives the serial result eagerly and replayed from a CUDA graph; on Hopper the kernels launch with PDL."""
    kernel: FastKernel = _reverse_add_kernel
    n, steps = 1 << 22, 40  # many waves of programs a launch
    grid = (triton.cdiv(n, 1024),)
    start = torch.randn(n, device='cuda')
    a, b = start.clone(), torch.empty_like(start)

    def chain():
        for i in range(steps):
            src, dst = (a, b) if i % 2 == 0 else (b, a)
            kernel[grid](src, dst, n, BLOCK=1024)
    expected = start.clone()
    for _ in range(steps):
        expected = expected.flip(0) + 1.0  # the same float32 additions, in the stream's order
    chain()
    torch.testing.assert_close(a, expected, rtol=0, atol=0)
    on_hopper = torch.cuda.get_device_capability()[0] >= 9
    assert kernel.has_pdl and all(k.metadata.launch_pdl == on_hopper for k in kernel._compiled.values())
    graph = torch.cuda.CUDAGraph()
    a.copy_(start)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        chain()
    for replay in range(1, 4):
        a.copy_(start)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(a, expected, rtol=0, atol=0, msg=f'replay {replay}')


# ------------------------------------------------------------------------------------------------ interpreter

@pytest.mark.skipif(INTERPRET, reason='already running under the interpreter')
def test_fused_kernels_interpreted():
    """Run the `test_cpu_*` tests in a subprocess with TRITON_INTERPRET=1 (set before Triton is imported)."""
    run_cpu_tests_interpreted(__file__)
