"""The one-row norm + linear (`kernels/cuda/gemv.norm_gemv`: residual add, RMSNorm and GEMV in one launch) against
a float64 reference of the unfused ops, and the `cuda` backend's `OpType.RMSNormLinear` dispatch to it (opt-in with
`LMDEPLOY_NORM_GEMV=1`).

Reference: s = x + residual rounded to the dtype (the residual stream, which must come back bit-exact), h = s *
rsqrt(mean(s^2) + eps) * w' in float64 (w' = 1 + w when zero-centred), y = h @ W^T. The kernel does not round h
before the dot, so y is within one rounding of the float64 value plus the float32 sums' error; the normed row it
stores on request is within one rounding of h. Shapes on purpose: widths that are a multiple of the kernel's step
and ones that leave a masked tail, row counts that are not a multiple of `BLOCK_N`, a weight that is a row slice
of a wider buffer, no residual (the first layer: s is x itself), and an empty weight (the residual and h are still
written). `test_cpu_*` run under the Triton interpreter in the subprocess `test_norm_gemv_kernel_interpreted`
starts; `@pytest.mark.gpu` tests run on CUDA, one inside a CUDA graph.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from interpreted import run_cpu_tests_interpreted

from lmdeploy.pytorch.kernels.cuda.gemv import norm_gemv

INTERPRET = os.environ.get('TRITON_INTERPRET') == '1'
interpreted = pytest.mark.skipif(not INTERPRET, reason='runs inside test_norm_gemv_kernel_interpreted')

SHAPES = [(1, 16), (7, 100), (300, 1024), (33, 1500)]   # (N, K)
GPU_SHAPES = SHAPES + [(12352, 2048), (257, 2048), (24576, 4096), (2048, 4096), (8192, 2048)]


def reference(x, residual, norm_w, eps, zero_centered, weight):
    s = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    s64 = s.double()
    scale = norm_w.double() + 1.0 if zero_centered else norm_w.double()
    h = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + eps) * scale
    return F.linear(h, weight.double()), s, h


def check_norm_gemv(n: int, k: int, dtype: torch.dtype, has_residual: bool, zero_centered: bool, strided: bool,
                    device: str) -> None:
    gen = torch.Generator().manual_seed(n * 13 + k)
    wide = (torch.randn(n, k + (24 if strided else 0), generator=gen) / k ** 0.5).to(dtype)
    weight = wide[:, :k]
    x = torch.randn(1, k, generator=gen).to(dtype)
    residual = torch.randn(1, k, generator=gen).to(dtype) if has_residual else None
    norm_w = (0.1 * torch.randn(k, generator=gen)).to(dtype)
    eps = 1e-6
    ref_y, ref_s, ref_h = reference(x, residual, norm_w, eps, zero_centered, weight)
    weight_dev = wide.to(device)[:, :k] if strided else weight.to(device)
    x_dev = x.to(device)
    y, s, h = norm_gemv(x_dev, None if residual is None else residual.to(device), norm_w.to(device), eps,
                        zero_centered, weight_dev, store_normed=True)
    assert y.shape == (1, n) and y.dtype == dtype and s.shape == x.shape and h.shape == x.shape
    if residual is None:
        assert s is x_dev                                  # the stream is x itself: nothing written
    ulp = torch.finfo(dtype).eps
    if device == 'cpu' and dtype == torch.bfloat16:  # the interpreter truncates to bf16: within one ulp there
        assert ((s.double() - ref_s.double()).abs() <= ulp * ref_s.double().abs()).all()
    else:
        assert torch.equal(s.cpu(), ref_s), 'the residual stream must be x + residual rounded once, bit-exact'
    ref_y, _, ref_h = reference(s.cpu(), None, norm_w, eps, zero_centered, weight)   # from the stream it wrote
    h_err = (h.cpu().double() - ref_h).abs()
    assert (h_err <= 1.01 * ulp * ref_h.abs() + 1e-6).all(), f'normed row off by {h_err.max().item():.3g}'
    abs_sum = F.linear(ref_h.abs(), weight.double().abs())
    tol = 1.01 * ulp * ref_y.abs() + 1e-5 * abs_sum + 1e-6
    err = (y.cpu().double() - ref_y).abs()
    assert (err <= tol).all(), f'norm_gemv [{n} x {k}] {dtype}: worst {(err / tol).max().item():.2f} of tolerance'


@interpreted
@pytest.mark.parametrize('n,k', SHAPES)
@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16], ids=['fp16', 'bf16'])
def test_cpu_norm_gemv_matches_reference(n, k, dtype):
    check_norm_gemv(n, k, dtype, has_residual=n != 7, zero_centered=k != 100, strided=n == 33, device='cpu')


@interpreted
def test_cpu_norm_gemv_empty_weight_still_writes_the_stream():
    x, r = torch.randn(1, 40).half(), torch.randn(1, 40).half()
    w = torch.randn(3, 40).half()
    y, s, h = norm_gemv(x, r, torch.zeros(40).half(), 1e-6, True, w[:0], store_normed=True)
    assert y.shape == (1, 0)
    assert torch.equal(s, x + r)
    torch.testing.assert_close(h.float(), F.rms_norm((x + r).float(), (40,), eps=1e-6), atol=2e-3, rtol=2e-3)


@interpreted
def test_cpu_backend_fuses_one_half_row_only(monkeypatch):
    """One contiguous fp16 / bf16 row takes the fused kernel; more rows, float32 and strided rows take the backend's
    norm then its linear, with the same results (h always returned there)."""
    from lmdeploy.pytorch.backends import cuda as backend
    from lmdeploy.pytorch.backends.default.elementwise import rms_norm_linear as reference_op
    calls = []
    monkeypatch.setattr(backend, '_NORM_GEMV', True)      # opt-in (LMDEPLOY_NORM_GEMV=1): slower on the H200
    monkeypatch.setattr(backend, 'norm_gemv', lambda *a, **kw: calls.append(a) or norm_gemv(*a, **kw))
    w16 = (torch.randn(12, 32) / 6).half()
    norm_w = (0.1 * torch.randn(32)).half()
    for x, residual, used in ((torch.randn(1, 32).half(), torch.randn(1, 32).half(), True),
                              (torch.randn(1, 32).half(), None, True),
                              (torch.randn(3, 32).half(), torch.randn(3, 32).half(), False),
                              (torch.randn(1, 32), torch.randn(1, 32), False),
                              (torch.randn(1, 64).half()[:, ::2], torch.randn(1, 32).half(), False)):
        calls.clear()
        w = w16 if x.dtype == torch.float16 else w16.float()
        nw = norm_w if x.dtype == torch.float16 else norm_w.float()
        y, s, h = backend.rms_norm_linear(x, residual, nw, 1e-6, True, w, store_normed=True)
        assert bool(calls) == used, (tuple(x.shape), x.dtype)
        ref_y, ref_s, ref_h = reference_op(x, residual, nw, 1e-6, True, w)
        assert torch.equal(s, ref_s)
        torch.testing.assert_close(y.float(), ref_y.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(h.float(), ref_h.float(), atol=2e-2, rtol=2e-2)


def test_norm_gemv_kernel_interpreted():
    run_cpu_tests_interpreted(__file__)


@pytest.mark.gpu
@pytest.mark.parametrize('n,k', GPU_SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16], ids=['bf16', 'fp16'])
@pytest.mark.parametrize('has_residual', [True, False], ids=['residual', 'first'])
def test_norm_gemv_matches_reference_gpu(n, k, dtype, has_residual):
    check_norm_gemv(n, k, dtype, has_residual=has_residual, zero_centered=n % 2 == 1, strided=n == 33,
                    device='cuda')


@pytest.mark.gpu
def test_norm_gemv_replays_in_cuda_graph_gpu():
    w = torch.randn(3000, 2048, device='cuda', dtype=torch.bfloat16) / 45
    x = torch.randn(1, 2048, device='cuda', dtype=torch.bfloat16)
    r = torch.randn(1, 2048, device='cuda', dtype=torch.bfloat16)
    nw = 0.1 * torch.randn(2048, device='cuda', dtype=torch.bfloat16)
    norm_gemv(x, r, nw, 1e-6, True, w, store_normed=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, s, h = norm_gemv(x, r, nw, 1e-6, True, w, store_normed=True)
    x.copy_(torch.randn_like(x))
    graph.replay()
    ref_y, ref_s, ref_h = reference(x.cpu(), r.cpu(), nw.cpu(), 1e-6, True, w.cpu())
    assert torch.equal(s.cpu(), ref_s)
    torch.testing.assert_close(h.cpu().double(), ref_h, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(y.cpu().double(), ref_y, atol=2e-2, rtol=1e-2)
