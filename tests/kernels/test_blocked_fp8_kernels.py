"""Block-wise FP8 kernels (`kernels/cuda/blocked_fp8*.py`) against their torch references
(`kernels/default/blocked_fp8.py`), which in turn are checked against plain float math.

* `test_cpu_*` run the Triton kernels on CPU tensors under the Triton interpreter (it handles float8_e4m3fn loads
  and dots exactly), inside the subprocess `test_triton_fp8_kernels_interpreted` starts (TRITON_INTERPRET must be
  set before Triton is imported). Shapes are tiny, blocks 16x16, with edge tiles on purpose. The interpreter's
  float -> FP8 store drops the exponent carry when a value rounds up into the next binade (127.9 -> 64 instead of
  128; seen with triton 3.9), so there the quantization kernel's scales are checked exactly and its FP8 values
  only away from a carry, and the GEMM tests take the torch quantization; the GPU tests check all of it.
* `@pytest.mark.gpu` tests run the same kernels on CUDA with the released 128x128 blocks.
"""
from __future__ import annotations

import os

import pytest
import torch
from interpreted import run_cpu_tests_interpreted
from numeric import assert_close

from lmdeploy.pytorch.kernels.default import blocked_fp8 as ref

INTERPRET = os.environ.get('TRITON_INTERPRET') == '1'
interpreted = pytest.mark.skipif(not INTERPRET, reason='runs inside test_triton_fp8_kernels_interpreted')
FP8 = torch.float8_e4m3fn


def fp8_weight(*shape: int, block: tuple[int, int], gen: torch.Generator, device='cpu'):
    """(FP8 weight, its float32 block scales) of a random weight."""
    w = torch.randn(*shape, generator=gen).to(FP8).to(device)
    grid = (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))
    return w, (torch.rand(*grid, generator=gen) * 0.02 + 0.005).to(device)


# ---- the references against plain float math (CPU) --------------------------------------------------------------
def test_reference_quantization_round_trips_within_one_fp8_step():
    x = torch.randn(5, 40, generator=torch.Generator().manual_seed(0)) * 3
    q, scale = ref.quant_fp8(x, 16)
    assert q.dtype == FP8 and scale.shape == (5, 3)
    back = q.float() * scale.repeat_interleave(16, dim=1)[:, :40]
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of each group's largest value
    amax = x.abs().view(5, -1).new_zeros(5, 3)
    for g in range(3):
        amax[:, g] = x[:, g * 16:(g + 1) * 16].abs().amax(dim=1)
    assert ((back - x).abs() <= amax.repeat_interleave(16, dim=1)[:, :40] * 2 ** -4 + 1e-12).all()


def test_reference_gemm_equals_float_math_on_dequantized_operands():
    gen = torch.Generator().manual_seed(1)
    a, a_scale = fp8_weight(7, 40, block=(1, 16), gen=gen)
    b, b_scale = fp8_weight(24, 40, block=(16, 16), gen=gen)
    a_real = a.double() * a_scale.double().repeat_interleave(16, dim=1)[:, :40]
    b_real = b.double() * b_scale.double().repeat_interleave(16, 0)[:24].repeat_interleave(16, 1)[:, :40]
    out = ref.blocked_gemm_fp8(a, a_scale, b, b_scale, (16, 16), torch.float32)
    assert_close(out, (a_real @ b_real.T).float(), atol=1e-5, rtol=1e-5)


# ---- Triton under the interpreter --------------------------------------------------------------------------------
@interpreted
@pytest.mark.parametrize('rows,cols', [(1, 16), (5, 40), (3, 33)], ids=['M1-K16', 'M5-K40', 'M3-K33'])
def test_cpu_quant_fp8_matches_reference(rows, cols):
    from lmdeploy.pytorch.kernels.cuda import blocked_fp8 as cuda
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)) * 2
    q, scale = cuda.quant_fp8(x, 16)
    q_ref, scale_ref = ref.quant_fp8(x, 16)
    assert torch.equal(scale, scale_ref)
    carry = q_ref.float().abs().log2().frac() == 0  # a power of two: possibly reached by rounding up
    assert torch.equal(q.float()[~carry], q_ref.float()[~carry])


@pytest.fixture
def torch_quantization(monkeypatch):
    """The interpreted GEMM tests quantize activations with the torch reference (see the module docstring)."""
    from lmdeploy.pytorch.kernels.cuda import blocked_fp8 as cuda
    from lmdeploy.pytorch.kernels.cuda import blocked_fp8_moe as cuda_moe
    monkeypatch.setattr(cuda, 'quant_fp8', ref.quant_fp8)
    monkeypatch.setattr(cuda_moe, 'quant_fp8', ref.quant_fp8)


@interpreted
@pytest.mark.parametrize('rows,cols,depth', [(1, 32, 32), (5, 24, 40), (20, 48, 16)],
                         ids=['M1-N32-K32', 'M5-N24-K40', 'M20-N48-K16'])
def test_cpu_blocked_gemm_matches_reference(rows, cols, depth):
    from lmdeploy.pytorch.kernels.cuda import blocked_fp8 as cuda
    gen = torch.Generator().manual_seed(rows + cols)
    a, a_scale = fp8_weight(rows, depth, block=(1, 16), gen=gen)
    b, b_scale = fp8_weight(cols, depth, block=(16, 16), gen=gen)
    out = cuda.blocked_gemm_fp8(a, a_scale, b, b_scale, (16, 16), torch.float32)
    assert_close(out, ref.blocked_gemm_fp8(a, a_scale, b, b_scale, (16, 16), torch.float32), atol=1e-5, rtol=1e-5)


@interpreted
def test_cpu_linear_blocked_fp8_matches_reference(torch_quantization):
    from lmdeploy.pytorch.kernels.cuda import blocked_fp8 as cuda
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 40, generator=gen)
    w, w_scale = fp8_weight(24, 40, block=(16, 16), gen=gen)
    bias = torch.randn(24, generator=gen)
    out = cuda.linear_blocked_fp8(x, w, w_scale, bias, (16, 16))
    assert_close(out, ref.linear_blocked_fp8(x, w, w_scale, bias, (16, 16)), atol=1e-3, rtol=1e-3)


@interpreted
def test_cpu_every_tile_matches_reference():
    # the autotuner may pick any tile: each must cover the edges (37 rows, 80 columns, K = 40 in blocks of 16)
    from lmdeploy.pytorch.kernels.cuda import blocked_fp8 as cuda
    gen = torch.Generator().manual_seed(5)
    a, a_scale = fp8_weight(37, 40, block=(1, 16), gen=gen)
    b, b_scale = fp8_weight(80, 40, block=(16, 16), gen=gen)
    expected = ref.blocked_gemm_fp8(a, a_scale, b, b_scale, (16, 16), torch.float32)
    for tile in cuda.GEMM_TILES:
        out = cuda.blocked_gemm_fp8(a, a_scale, b, b_scale, (16, 16), torch.float32, tile=tile)
        assert_close(out, expected, atol=1e-5, rtol=1e-5, what=f'tile {tile}')


def test_row_buckets_cover_every_count_and_their_tiles_fit():
    pytest.importorskip('triton')
    from lmdeploy.pytorch.kernels.cuda import blocked_fp8 as cuda
    rows = (1, 16, 17, 64, 65, 200, 257, 1024, 1025, 9000)
    assert [cuda.m_bucket(r) for r in rows] == [16, 16, 32, 64, 128, 256, 1024, 1024, 4096, 4096]
    for bucket in cuda.M_BUCKETS:
        tiles = cuda.tiles_for_bucket(bucket)
        assert tiles and set(tiles) <= set(cuda.GEMM_TILES) and all(t[0] <= bucket for t in tiles), bucket
    assert {t[0] for t in cuda.tiles_for_bucket(16)} == {16}  # decode times only 16-row tiles
    assert {t[0] for t in cuda.tiles_for_bucket(4096)} == {64, 128}


def test_autotuner_keys_on_kernel_arguments_and_prunes_by_bucket():
    # a key that names no kernel argument is silently dropped by older Triton: the kernel would tune once, ever
    pytest.importorskip('triton')
    from lmdeploy.pytorch.kernels.cuda import blocked_fp8 as cuda
    tuner = cuda._tuned_gemm_fp8_kernel
    assert list(tuner.keys) == ['N', 'K', 'M_BUCKET', 'BLOCK_SIZE_N', 'BLOCK_K']
    assert set(tuner.keys) <= set(tuner.arg_names)
    assert len(tuner.configs) == len(cuda.GEMM_TILES)
    for bucket in (16, 64, 1024):
        kept = cuda._prune_tiles(tuner.configs, {}, M_BUCKET=bucket)
        assert [(c.kwargs['BLOCK_M'], c.kwargs['BLOCK_N'], c.num_warps, c.num_stages) for c in kept] == \
            cuda.tiles_for_bucket(bucket)


def _moe_inputs(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int, block, device='cpu', seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(device)
    gate_up, gate_up_scale = fp8_weight(num_experts, 2 * inter, hidden, block=block, gen=gen, device=device)
    down, down_scale = fp8_weight(num_experts, hidden, inter, block=block, gen=gen, device=device)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return x, gate_up, down, weights.to(device), ids.to(device), gate_up_scale, down_scale


@interpreted
@pytest.mark.parametrize('cols_first', [False, True], ids=['rows-first', 'cols-first'])
@pytest.mark.parametrize('num_tokens', [1, 7, 256], ids=['T1', 'T7', 'T256'])
def test_cpu_fused_moe_blocked_fp8_matches_reference(num_tokens, cols_first, torch_quantization, monkeypatch):
    """The default tiles: a decode's, a short prompt's and (T256: 128 rows an expert) `FP8_LARGE_ROWS`'."""
    from lmdeploy.pytorch.kernels.cuda import moe
    from lmdeploy.pytorch.kernels.cuda.blocked_fp8_moe import fused_moe_blocked_fp8
    # the expert GEMMs' program order, LMDEPLOY_MOE_COLS_FIRST
    monkeypatch.setattr(moe, '_COLS_FIRST_MODE', '1' if cols_first else '0')
    args = _moe_inputs(num_tokens, hidden=40, inter=32, num_experts=4, top_k=2, block=(16, 16), seed=num_tokens)
    out = fused_moe_blocked_fp8(*args, block_size=(16, 16))
    assert_close(out, ref.fused_moe_blocked_fp8(*args, block_size=(16, 16)), atol=1e-7, rtol=1e-4)


@interpreted
@pytest.mark.parametrize('config', [((16, (16, 4, 2), (64, 8, 4))), (32, (64, 8, 4), (16, 4, 2)), (64, (32, 4, 3),
                                                                                                  (32, 4, 3))],
                         ids=['M16', 'M32', 'M64'])
def test_cpu_fused_moe_blocked_fp8_tiles(config, torch_quantization):
    """Tiles other than the default's (`benchmark/bench_fp8_moe.py` sweeps them): row blocks of 16-64, column tiles
    narrower and wider than the weights' 16-row scale blocks, the same result as the reference."""
    from lmdeploy.pytorch.kernels.cuda.blocked_fp8_moe import Fp8MoeConfig, fused_moe_blocked_fp8
    args = _moe_inputs(9, hidden=40, inter=32, num_experts=4, top_k=2, block=(16, 16), seed=3)
    out = fused_moe_blocked_fp8(*args, block_size=(16, 16), config=Fp8MoeConfig(*config))
    assert_close(out, ref.fused_moe_blocked_fp8(*args, block_size=(16, 16)), atol=1e-7, rtol=1e-4)


@interpreted
def test_cpu_fp8_moe_warm_up_runs_every_count_it_names():
    """The start-up warm-up of FP8 experts (`ModelAgent.tune_kernels`) calls the op once per token count
    `warm_up_token_counts` names (one row block and alignment launch each), on the experts' own tensors."""
    from lmdeploy.pytorch.kernels.cuda import blocked_fp8_moe
    _, gate_up, down, _, _, gate_up_scale, down_scale = _moe_inputs(1, hidden=40, inter=32, num_experts=4, top_k=2,
                                                                    block=(16, 16))
    counts = blocked_fp8_moe.warm_up_token_counts(4, 2, 40)
    assert blocked_fp8_moe.warm_up_tiles(gate_up, down, gate_up_scale, down_scale, (16, 16), 2, 40,
                                         torch.float32) == len(counts) >= 3


@pytest.mark.skipif(INTERPRET, reason='already running under the interpreter')
def test_triton_fp8_kernels_interpreted():
    """Run the `test_cpu_*` tests in a subprocess with TRITON_INTERPRET=1 (set before Triton is imported)."""
    run_cpu_tests_interpreted(__file__)


# ---- CUDA ------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_quant_fp8_matches_reference_on_cuda():
    from lmdeploy.pytorch.kernels.cuda import blocked_fp8 as cuda
    x = torch.randn(300, 2176, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    q, scale = cuda.quant_fp8(x.cuda(), 128)
    q_ref, scale_ref = ref.quant_fp8(x, 128)
    assert_close(scale.cpu(), scale_ref, atol=0, rtol=1e-6)
    # the GPU's float32 division may differ in the last bit, which can flip a rounding tie: one FP8 step, rarely
    # (0.13% of the elements on the H200)
    diff = (q.cpu().float() - q_ref.float()).abs()
    assert (diff <= q_ref.float().abs() * 2 ** -3 + 2 ** -9).all() and (diff > 0).float().mean() < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize('rows', [1, 64, 300], ids=['M1', 'M64', 'M300'])
@pytest.mark.parametrize('cols,depth', [(2048, 2048), (640, 2176)], ids=['N2048-K2048', 'N640-K2176'])
def test_blocked_gemm_matches_reference_on_cuda(rows, cols, depth):
    from lmdeploy.pytorch.kernels.cuda import blocked_fp8 as cuda
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, depth, generator=gen).to(torch.bfloat16).cuda()
    w, w_scale = fp8_weight(cols, depth, block=(128, 128), gen=gen, device='cuda')
    expected = ref.linear_blocked_fp8(x.cpu().float(), w.cpu(), w_scale.cpu(), None, (128, 128))
    assert_close(cuda.linear_blocked_fp8(x, w, w_scale, None, (128, 128)), expected, atol=3e-2, rtol=3e-2)
    if cuda.torch_scaled_mm_supported(torch.device('cuda', 0)) and cols % 128 == 0 and depth % 128 == 0:
        got = cuda.linear_blocked_fp8(x, w, w_scale, None, (128, 128), use_torch=True)
        assert_close(got, expected, atol=3e-2, rtol=3e-2, what='torch._scaled_mm')


@pytest.mark.gpu
def test_every_tile_matches_reference_on_cuda():
    from lmdeploy.pytorch.kernels.cuda import blocked_fp8 as cuda
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(300, 2176, generator=gen).to(torch.bfloat16).cuda()
    w, w_scale = fp8_weight(640, 2176, block=(128, 128), gen=gen, device='cuda')
    expected = ref.linear_blocked_fp8(x.cpu().float(), w.cpu(), w_scale.cpu(), None, (128, 128))
    for tile in cuda.GEMM_TILES:
        got = cuda.linear_blocked_fp8(x, w, w_scale, None, (128, 128), tile=tile)
        assert_close(got, expected, atol=3e-2, rtol=3e-2, what=f'tile {tile}')


@pytest.mark.gpu
def test_start_up_tuning_covers_every_bucket_so_forwards_only_look_up():
    from lmdeploy.pytorch.kernels.cuda import blocked_fp8 as cuda
    if not cuda.AUTOTUNE:
        pytest.skip('LMDEPLOY_FP8_AUTOTUNE=0')
    device = torch.device('cuda', 0)
    shape = (384, 1152, (128, 128))
    assert cuda.tune_blocked_gemm_fp8({shape}, 300, torch.bfloat16, device) == 6  # buckets 16 ... 1024
    for rows in (16, 32, 64, 128, 256, 1024):
        assert cuda.tuned_tile(384, 1152, rows, (128, 128), torch.bfloat16) in cuda.tiles_for_bucket(rows)
    assert cuda.tuned_tile(384, 1152, 4096, (128, 128), torch.bfloat16) is None  # past max_rows: not tuned
    tuner = cuda._tuned_gemm_fp8_kernel
    keys = len(tuner.cache)
    gen = torch.Generator().manual_seed(8)
    w, w_scale = fp8_weight(384, 1152, block=(128, 128), gen=gen, device='cuda')
    for rows in (1, 5, 48, 300):
        x = torch.randn(rows, 1152, generator=gen).to(torch.bfloat16).cuda()
        expected = ref.linear_blocked_fp8(x.cpu().float(), w.cpu(), w_scale.cpu(), None, (128, 128))
        assert_close(cuda.linear_blocked_fp8(x, w, w_scale, None, (128, 128)), expected, atol=3e-2, rtol=3e-2)
    assert len(tuner.cache) == keys  # nothing was tuned at first use


@pytest.mark.gpu
@pytest.mark.parametrize('num_tokens', [1, 64, 513], ids=['T1', 'T64', 'T513'])
def test_fused_moe_blocked_fp8_matches_reference_on_cuda(num_tokens):
    from lmdeploy.pytorch.kernels.cuda.blocked_fp8_moe import fused_moe_blocked_fp8
    args = _moe_inputs(num_tokens, hidden=2048, inter=512, num_experts=16, top_k=4, block=(128, 128), device='cuda',
                       seed=num_tokens)
    x, *rest = args
    out = fused_moe_blocked_fp8(x.bfloat16(), *rest, block_size=(128, 128))
    expected = ref.fused_moe_blocked_fp8(x.bfloat16().float().cpu(), *[t.cpu() for t in rest], block_size=(128, 128))
    assert_close(out, expected, atol=5e-2, rtol=5e-2)
    # the outputs' mean magnitude is ~0.03, below that atol: the error's RMS against theirs as well (bf16
    # intermediates and FP8 re-quantization flip a few values by one FP8 step; a missing or misplaced tile is ~50%)
    rms = ((out.float().cpu() - expected).pow(2).mean() / expected.pow(2).mean()).sqrt().item()
    assert rms < 0.1, f'RMS error {rms:.3f} of the outputs RMS'


@pytest.mark.gpu
@pytest.mark.parametrize('cols_first', [False, True], ids=['rows-first', 'cols-first'])
@pytest.mark.parametrize('block_m', [16, 32, 64, 128])
def test_fused_moe_blocked_fp8_every_row_block_matches_reference_on_cuda(block_m, cols_first, monkeypatch):
    """A prefill's 256 rows an expert (the two-launch alignment) at every row block a config may take, in both program
    orders (`bench_fp8_moe.py`'s sweep found BLOCK_M 32 off the 64 by more than its elementwise tolerance at 256 rows
    an expert: mma.sync against wgmma accumulation, re-quantized to FP8, or a misplaced tile; the RMS tells them
    apart: ~2.5% for the first under the interpreter with torch's quantization, ~100% for the second). The reference
    runs on the GPU in float32."""
    from lmdeploy.pytorch.kernels.cuda import blocked_fp8_moe, moe
    monkeypatch.setattr(moe, '_COLS_FIRST_MODE', '1' if cols_first else '0')
    x, *rest = _moe_inputs(2048, hidden=512, inter=256, num_experts=32, top_k=4, block=(128, 128), device='cuda',
                           seed=block_m)
    config = blocked_fp8_moe.Fp8MoeConfig(block_m, (64, 4, 3), (64, 4, 3))
    out = blocked_fp8_moe.fused_moe_blocked_fp8(x.bfloat16(), *rest, (128, 128), config=config)
    expected = ref.fused_moe_blocked_fp8(x.bfloat16().float(), *rest, block_size=(128, 128))
    rms = ((out.float() - expected).pow(2).mean() / expected.pow(2).mean()).sqrt().item()
    assert rms < 0.1, f'RMS error {rms:.3f} of the outputs RMS'


@pytest.mark.gpu
def test_fp8_moe_warm_up_compiles_every_binary_a_forward_takes():
    """After `warm_up_tiles` (what start-up runs for block-wise FP8 experts), no token count up to its limit compiles
    another binary of the FP8 MoE or of the alignment (top-8 of 64 experts: BLOCK_M 16 / 32 / 64, the one-program
    alignment at 8 and 16 warps, the two launches)."""
    from lmdeploy.pytorch.kernels.cuda import blocked_fp8, blocked_fp8_moe, moe_align
    from lmdeploy.pytorch.kernels.cuda.launch import FastKernel
    _, gate_up, down, _, _, gate_up_scale, down_scale = _moe_inputs(1, hidden=256, inter=128, num_experts=64,
                                                                    top_k=8, block=(128, 128), device='cuda')
    kernels = [k for mod in (blocked_fp8, blocked_fp8_moe, moe_align) for k in vars(mod).values()
               if isinstance(k, FastKernel)]
    limit = 1100
    blocked_fp8_moe.warm_up_tiles(gate_up, down, gate_up_scale, down_scale, (128, 128), 8, limit, torch.bfloat16)
    compiled = sum(k.num_compiled for k in kernels)
    for tokens in range(1, limit + 1, 7):
        x = torch.randn(tokens, 256, device='cuda', dtype=torch.bfloat16)
        weights, ids = torch.randn(tokens, 64, device='cuda').softmax(-1).topk(8, dim=-1)
        blocked_fp8_moe.fused_moe_blocked_fp8(x, gate_up, down, weights.bfloat16(), ids, gate_up_scale, down_scale,
                                              (128, 128))
    assert sum(k.num_compiled for k in kernels) == compiled
