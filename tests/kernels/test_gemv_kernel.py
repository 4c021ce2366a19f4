"""The one-row linear (`kernels/cuda/gemv.py`) against `torch.nn.functional.linear` in float64, and the `cuda`
backend's dispatch to it (one-row half-precision inputs only; `LMDEPLOY_TRITON_GEMV=0` turns it off).

Shapes on purpose: widths K that are a multiple of the kernel's step and ones that leave a masked tail (or are
smaller than one step), row counts N that are not a multiple of `BLOCK_N`, N = 1, and a weight that is a row
slice of a wider buffer (its row stride is not K). `test_cpu_*` run on CPU tensors under the Triton interpreter in
the subprocess `test_gemv_kernel_interpreted` starts; `@pytest.mark.gpu` tests run on CUDA, one inside a CUDA graph.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from interpreted import run_cpu_tests_interpreted

from lmdeploy.pytorch.kernels.cuda.gemv import gemv, gemv_config

INTERPRET = os.environ.get('TRITON_INTERPRET') == '1'
interpreted = pytest.mark.skipif(not INTERPRET, reason='runs inside test_gemv_kernel_interpreted')

SHAPES = [(1, 16), (7, 100), (300, 1024), (33, 1500), (1000, 64)]   # (N, K)
GPU_SHAPES = SHAPES + [(4096, 4096), (24576, 4096), (64, 2048), (2048, 4096), (248320 // 16, 4096)]


def check_gemv(n: int, k: int, dtype: torch.dtype, has_bias: bool, strided: bool, device: str) -> None:
    gen = torch.Generator().manual_seed(n * 7 + k)
    wide = torch.randn(n, k + (24 if strided else 0), generator=gen).to(dtype)
    weight = wide[:, :k]
    x = torch.randn(1, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if has_bias else None
    ref = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    weight_dev = wide.to(device)[:, :k] if strided else weight.to(device)
    out = gemv(x.to(device), weight_dev, None if bias is None else bias.to(device))
    assert out.shape == (1, n) and out.dtype == dtype
    # Per element: one rounding of the fp32 sum to the dtype (the interpreter truncates: under one ulp, eps x |y|)
    # and the fp32 summation's error, bounded loosely by 1e-5 of the sum of the products' magnitudes.
    abs_sum = F.linear(x.double().abs(), weight.double().abs(), None if bias is None else bias.double().abs())
    tol = 1.01 * torch.finfo(dtype).eps * ref.abs() + 1e-5 * abs_sum + 1e-6
    err = (out.cpu().double() - ref).abs()
    assert (err <= tol).all(), f'gemv [{n} x {k}] {dtype}: worst {(err / tol).max().item():.2f} of the tolerance'


@interpreted
@pytest.mark.parametrize('n,k', SHAPES[:4])
@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16], ids=['fp16', 'bf16'])
def test_cpu_gemv_matches_linear(n, k, dtype):
    check_gemv(n, k, dtype, has_bias=n % 2 == 1, strided=n == 33, device='cpu')


@interpreted
def test_cpu_gemv_takes_a_flat_row_and_empty_weights():
    x = torch.randn(40).to(torch.float16)
    w = torch.randn(9, 40).to(torch.float16)
    out = gemv(x, w)
    assert out.shape == (9,)
    torch.testing.assert_close(out.float(), F.linear(x.float(), w.float()), atol=2e-2, rtol=2e-3)
    assert gemv(x[None], w[:0]).shape == (1, 0)


@interpreted
def test_cpu_backend_dispatches_one_half_row_only(monkeypatch):
    from lmdeploy.pytorch.backends.cuda import triton_gemv_linear
    calls = []
    monkeypatch.setattr('lmdeploy.pytorch.backends.cuda.gemv', lambda *a: calls.append(a) or gemv(*a))
    w = torch.randn(12, 32).to(torch.float16)
    for x, used in ((torch.randn(1, 32).half(), True), (torch.randn(2, 32).half(), False),
                    (torch.randn(1, 32), False), (torch.randn(1, 64).half()[:, ::2], False)):
        calls.clear()
        out = triton_gemv_linear(x, w if x.dtype == torch.float16 else w.float())
        assert bool(calls) == used, (tuple(x.shape), x.dtype)
        torch.testing.assert_close(out.float(), F.linear(x.float(), w.float()), atol=2e-2, rtol=2e-3)


def test_gemv_kernel_interpreted():
    run_cpu_tests_interpreted(__file__)


def test_gemv_config_follows_the_sweep():
    # the H200's best tiles per shape (run 34): wide weights 16 x 256, narrow ones a row of 512-column steps,
    # weights of at most 4M elements 1024-column steps on 8 warps, short rows (k = 512) four to a program
    assert gemv_config(248320, 4096, 132) == dict(BLOCK_N=16, BLOCK_K=256, num_warps=4)
    assert gemv_config(12288, 2048, 132) == dict(BLOCK_N=16, BLOCK_K=256, num_warps=4)
    assert gemv_config(4096, 12288, 132) == dict(BLOCK_N=1, BLOCK_K=512, num_warps=4)
    assert gemv_config(2048, 4096, 132) == dict(BLOCK_N=1, BLOCK_K=512, num_warps=4)
    assert gemv_config(64, 4096, 132) == dict(BLOCK_N=1, BLOCK_K=1024, num_warps=8)
    assert gemv_config(1024, 2048, 132) == dict(BLOCK_N=1, BLOCK_K=1024, num_warps=8)
    assert gemv_config(2048, 512, 132) == dict(BLOCK_N=4, BLOCK_K=512, num_warps=8)
    assert gemv_config(9, 40, 132) == dict(BLOCK_N=16, BLOCK_K=64, num_warps=8)
    assert gemv_config(12288, 4096, 16)['BLOCK_N'] == 16                              # "wide" counts SMs


@pytest.mark.gpu
@pytest.mark.parametrize('n,k', GPU_SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16], ids=['bf16', 'fp16'])
def test_gemv_matches_linear_gpu(n, k, dtype):
    check_gemv(n, k, dtype, has_bias=n % 2 == 1, strided=n == 33, device='cuda')


@pytest.mark.gpu
def test_gemv_replays_in_cuda_graph_gpu():
    w = torch.randn(3000, 2048, device='cuda', dtype=torch.bfloat16)
    x = torch.randn(1, 2048, device='cuda', dtype=torch.bfloat16)
    gemv(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out.float(), F.linear(x.float(), w.float()), atol=0.05, rtol=1e-2)
