"""The block-wise FP8 experts' tiles (`kernels/cuda/blocked_fp8_moe.py`) swept on the GPU, against the default
tiles (`default_fp8_config`) and the bf16 experts of the same shape (`moe.fused_moe` at its table's or untuned tiles).

Experts `--experts` x (H `--hidden`, I `--inter`) FP8 with 128 x 128 weight blocks (a released checkpoint's layout),
top-`--top-k` uniform routing; device us per call in CUDA-graph replays, weights rotated over `--layers` copies so
that a repeat never finds them in L2. The sweep tries BLOCK_M, then the up launch's (BLOCK_N, warps, stages) with
the default down tiles, then the down launch's with the best up; a config whose output's error RMS against the
default tiles' exceeds `MAX_REL_RMS` of theirs is refused, one that does not fit (shared memory, registers)
skipped. `floor`: the touched experts' FP8 weights and their scales read once at the measured copy rate
(`real_depth_floors.measure_device`); the FP8 GEMMs' FLOPs are not in it.

    python benchmark/bench_fp8_moe.py                                  # Qwen3.5-35B-A3B's experts (256, top-8)
    python benchmark/bench_fp8_moe.py --experts 512 --top-k 10         # Qwen3-Next-80B's
    python benchmark/bench_fp8_moe.py --tokens 1024 8192 --no-sweep    # default tiles against bf16 only

Each count prints one table row and, with the sweep, a BEST line (the config as `Fp8MoeConfig(...)` arguments).
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_moe_kernel  # noqa: E402
from bench_fp8_gemm import BLOCK, quantize  # noqa: E402  (128 x 128 weight blocks, one scale each)
from graph_timing import graph_us  # noqa: E402
from real_depth_floors import measure_device  # noqa: E402

from lmdeploy.pytorch.kernels.cuda import blocked_fp8_moe, moe  # noqa: E402

Fp8MoeConfig = blocked_fp8_moe.Fp8MoeConfig


def block_ms(rows_per_expert: float) -> tuple[int, ...]:
    """The row blocks worth trying for this many rows an expert."""
    return (16, 32) if rows_per_expert <= 16 else (16, 32, 64) if rows_per_expert <= 64 else (32, 64, 128)


def launch_tiles() -> list[tuple[int, int, int]]:
    """(BLOCK_N, num_warps, num_stages) of one launch."""
    return list(itertools.product((32, 64, 128, 256), (4, 8), (2, 3, 4)))


class Case(bench_moe_kernel.Case):
    """`bench_moe_kernel.Case`'s routing of `tokens` tokens over `layers` copies of FP8 experts and of the same
    experts in bf16."""

    def __init__(self, a, tokens: int, experts: list):
        super().__init__(a, tokens, [bf16 for _, bf16 in experts])
        self.fp8 = [fp8 for fp8, _ in experts]

    def run(self, config: Fp8MoeConfig | None = None, i: int = 0) -> torch.Tensor:
        gu, gu_s, d, d_s = self.fp8[i % len(self.fp8)]
        return blocked_fp8_moe.fused_moe_blocked_fp8(self.x, gu, d, self.w, self.ids, gu_s, d_s, BLOCK, config=config)

    def run_bf16(self, i: int = 0) -> torch.Tensor:
        return super().run(None, i)


# Acceptance of a swept config: its output's error RMS against the default tiles', relative to their RMS. Not an
# elementwise bound: row blocks below 64 run mma.sync, from 64 up wgmma, whose float32 sums differ in the last bits,
# and the SwiGLU output re-quantized to FP8 turns a few of those into one FP8 step (H100, 8,192 tokens x top-8: BLOCK_M
# 32 against 64 failed a 2e-2 elementwise check). That noise is ~2.5% of the outputs' RMS against the torch reference
# (tests/kernels/test_blocked_fp8_kernels.py, whose GPU tests take the same 10% bound); a missing or misplaced tile
# is an error of ~100%.
MAX_REL_RMS = 0.1


def try_time(case: Case, config: Fp8MoeConfig, layers: int, want: torch.Tensor | None = None) -> float:
    """Device us per call; inf where the tiles do not fit (shared memory, registers) or the output is off."""
    if want is not None:
        try:
            got = case.run(config).float()
        except Exception as exc:
            if 'out of resource' in str(exc).lower() or 'OutOfResources' in type(exc).__name__:
                return float('inf')
            raise
        rel = ((got - want).pow(2).mean() / want.pow(2).mean()).sqrt().item()
        if not rel < MAX_REL_RMS:
            print(f'  refused {tuple(config)}: error RMS {rel:.3f} of the default tiles\' output', flush=True)
            return float('inf')
    return bench_moe_kernel.try_time(case, config, layers)


def sweep(case: Case, a, default: Fp8MoeConfig, want: torch.Tensor) -> tuple[float, Fp8MoeConfig]:
    best = (try_time(case, default, a.layers), default)
    for bm in block_ms(case.x.shape[0] * a.top_k / a.experts):
        for up in launch_tiles():
            cfg = Fp8MoeConfig(bm, up, default.down)
            best = min(best, (try_time(case, cfg, a.layers, want), cfg), key=lambda b: b[0])
    bm, up = best[1].block_m, best[1].up
    for down in launch_tiles():
        cfg = Fp8MoeConfig(bm, up, down)
        best = min(best, (try_time(case, cfg, a.layers, want), cfg), key=lambda b: b[0])
    return best


def floor_us(a, case: Case, rates) -> float:
    """The touched experts' FP8 weights and float32 block scales, read once."""
    weights = case.touched * 3 * a.hidden * a.inter
    scales = case.touched * 3 * (a.hidden // BLOCK[1]) * (a.inter // BLOCK[0]) * 4
    return (weights + scales) / rates.copy_bytes_per_s * 1e6


def make_experts(a) -> list:
    experts = []
    for _ in range(a.layers):
        gate_up = torch.randn(a.experts, 2 * a.inter, a.hidden, device='cuda') / a.hidden ** 0.5
        down = torch.randn(a.experts, a.hidden, a.inter, device='cuda') / a.inter ** 0.5
        (gu, gu_s), (d, d_s) = quantize(gate_up), quantize(down)
        experts.append(((gu, gu_s, d, d_s), (gate_up.bfloat16(), down.bfloat16())))
        del gate_up, down
    return experts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--hidden', type=int, default=2048)
    p.add_argument('--inter', type=int, default=512, help='moe_intermediate_size (a multiple of 128)')
    p.add_argument('--experts', type=int, default=256)
    p.add_argument('--top-k', type=int, default=8)
    p.add_argument('--tokens', type=int, nargs='+', default=[100, 1024, 4096, 8192])
    p.add_argument('--layers', type=int, default=3, help='expert copies rotated through')
    p.add_argument('--sweep', action=argparse.BooleanOptionalAction, default=True)
    a = p.parse_args()
    if a.inter % BLOCK[0] or a.hidden % BLOCK[1]:
        raise SystemExit(f'hidden {a.hidden} and inter {a.inter} must be multiples of 128 (the weight blocks)')
    rates = measure_device(torch.device('cuda'), torch.bfloat16)
    print(f'device {moe.cuda_device_name(torch.cuda.current_device())}, commit '
          f'{os.environ.get("LMDEPLOY_COMMIT", "?")}; copy {rates.copy_bytes_per_s / 1e9:.0f} GB/s; FP8 experts '
          f'{a.experts} x (H {a.hidden}, I {a.inter}), 128 x 128 blocks, top-{a.top_k}; device us per call (CUDA '
          'graph replays)', flush=True)
    experts = make_experts(a)
    print('tokens | bf16 us | fp8 default us | fp8 best us | best / default | best / floor | floor us | '
          'best config (BLOCK_M, up, down)', flush=True)
    for tokens in a.tokens:
        case = Case(a, tokens, experts)
        default = blocked_fp8_moe.default_fp8_config(tokens * a.top_k, a.experts)
        want = case.run(default).float()
        t_bf16 = graph_us(case.run_bf16, a.layers)
        t_default = try_time(case, default, a.layers)
        t_best, cfg = sweep(case, a, default, want) if a.sweep else (t_default, default)
        floor = floor_us(a, case, rates)
        print(f'{tokens:6d} | {t_bf16:7.1f} | {t_default:14.1f} | {t_best:11.1f} | {t_best / t_default:14.2f} | '
              f'{t_best / floor:12.2f} | {floor:8.1f} | {tuple(cfg)}', flush=True)
        if a.sweep:
            print(f'BEST tokens {tokens} rows_per_expert {tokens * a.top_k / a.experts:.1f}: '
                  f'Fp8MoeConfig({cfg.block_m}, {cfg.up}, {cfg.down})', flush=True)


if __name__ == '__main__':
    main()
