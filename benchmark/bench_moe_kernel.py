"""The fused MoE kernel (`kernels/cuda/moe.py`) on the device, per token count, against its floor and a batched GEMM:
- `untuned`: the tiles used without a table (`moe.default_config` with no device name); `table`: what the table
  for this shape and device picks (the shipped one, or LMDEPLOY_MOE_CONFIG_DIR's), if any; `best`: the fastest of
  a sweep (first the up GEMM's (BLOCK_N, BLOCK_K, num_warps, num_stages) per BLOCK_M with the down GEMM untuned,
  then the down GEMM's with the best up); each a whole `fused_moe` call (alignment, both GEMMs, the top-k sum),
  device time: `--layers` calls (one per weight copy) captured in one CUDA graph, replayed;
- `floor`: max(bytes of the experts the batch touches / copy rate, FLOPs / matmul rate), the rates measured here
  (`real_depth_floors.measure_device`);
- `bmm`: `torch.bmm` over the experts with the same rows per expert (uniform routing: the grouped-GEMM speed the
  kernel chases), up and down, no routing.
Weights rotate over `--layers` copies so a repeat never finds them in L2. Outputs of the best configs are checked
against the untuned ones (a config whose output differs by more than bf16 rounding is refused). Also: the Triton
alignment against the torch one (`LMDEPLOY_MOE_ALIGN=torch`), eager and replayed in a CUDA graph with new routing
each replay, and the device time of each. `--write-config DIR` writes the best configs as this shape's table
(`moe.config_file_name`, keyed by (token, expert) pair counts), the file `kernels/cuda/moe_configs/` ships.

`--orders`: also the table's tiles in both of the expert GEMMs' program orders (row blocks first, column tiles first:
`moe.cols_first`, which the engine picks by rows an expert, LMDEPLOY_MOE_COLS_FIRST), each output checked against
the untuned config's.

`--gemv`: also the few-token path of `kernels/cuda/moe_gemv.py` (which `fused_moe` takes for up to
`moe_gemv.MAX_TOKENS` tokens unless `LMDEPLOY_MOE_GEMV=0`), called directly for every count up to 16 tokens (the
crossover), its output checked against the untuned `fused_moe`'s, at its default tiles. `--gemv-sweep`: also its
tiles swept (`moe_gemv.default_tiles`' form, the up launch's then the down launch's), the best printed per count as
a GEMV_SWEEP line.

    python benchmark/bench_moe_kernel.py                           # Qwen3.5-35B-A3B experts (64 kept), ~2 min, H200
    python benchmark/bench_moe_kernel.py --tokens 1 2 4 8 16 --no-sweep --gemv    # the decode counts, both paths
    python benchmark/bench_moe_kernel.py --top-k 10 --no-sweep     # Qwen3-Next-80B routing, the table only
    python benchmark/bench_moe_kernel.py --tokens 1 4 --no-sweep --gemv --gemv-sweep   # the few-token path's tiles
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from graph_timing import graph_us  # noqa: E402
from real_depth_floors import measure_device  # noqa: E402

from lmdeploy.pytorch.kernels.cuda import moe, moe_align, moe_gemv  # noqa: E402


class Case:
    """Rotating weight copies and one routing of `tokens` tokens."""

    def __init__(self, a, tokens: int, weights: list[tuple[torch.Tensor, torch.Tensor]]):
        gen = torch.Generator(device='cuda').manual_seed(tokens)
        self.x = torch.randn(tokens, a.hidden, device='cuda', generator=gen, dtype=torch.bfloat16)
        logits = torch.randn(tokens, a.experts, device='cuda', generator=gen)
        topw, self.ids = logits.softmax(-1).topk(a.top_k, dim=-1)
        self.w = (topw / topw.sum(-1, keepdim=True)).bfloat16()
        self.weights = weights
        self.touched = int(self.ids.unique().numel())

    def run(self, config=None, i: int = 0) -> torch.Tensor:
        gate_up, down = self.weights[i % len(self.weights)]
        return moe.fused_moe(self.x, gate_up, down, self.w, self.ids, config)

    def run_gemv(self, i: int = 0, config: dict | None = None) -> torch.Tensor:
        gate_up, down = self.weights[i % len(self.weights)]
        return moe_gemv.fused_moe_gemv(self.x, gate_up, down, self.w, self.ids, config=config)


def up_grid(block_m: int):
    if block_m <= 16:   # few rows per expert: weight streaming; narrow column tiles give more programs
        return list(itertools.product((16, 32, 64), (128, 256), (4,), (3, 4)))
    return list(itertools.product((64, 128), (64, 128), (4, 8), (3, 4)))


def down_grid(block_m: int):
    if block_m <= 16:
        return list(itertools.product((32, 64, 128), (64, 128), (4, 8), (3,)))
    return list(itertools.product((64, 128), (64, 128), (4, 8), (3,)))


def block_ms(rows_per_expert: float):
    return (16,) if rows_per_expert <= 16 else (16, 32, 64) if rows_per_expert <= 64 else (64, 128)


def try_time(case: Case, config, layers: int, want: torch.Tensor | None = None) -> float:
    """Device us per call, or inf when the tiles do not fit (shared memory / registers) or the output is off."""
    try:
        if want is not None and not torch.allclose(case.run(config).float(), want, rtol=2e-2, atol=2e-2):
            print(f'  refused {tuple(config)}: output differs from the untuned config', flush=True)
            return float('inf')
        return graph_us(lambda i: case.run(config, i), layers)
    except Exception as exc:
        if 'out of resource' in str(exc).lower() or 'OutOfResources' in type(exc).__name__:
            return float('inf')
        raise


def sweep(case: Case, a, untuned, want: torch.Tensor):
    rows = case.x.shape[0] * a.top_k / a.experts
    best = (try_time(case, untuned, a.layers), untuned)
    for bm in block_ms(rows):
        for up in up_grid(bm):
            cfg = moe.MoeConfig(bm, up, untuned.down)
            best = min(best, (try_time(case, cfg, a.layers, want), cfg))
    bm, up = best[1].block_m, best[1].up
    for down in down_grid(bm):
        cfg = moe.MoeConfig(bm, up, down)
        best = min(best, (try_time(case, cfg, a.layers, want), cfg))
    return best


def gemv_time(case: Case, config: dict, layers: int, want: torch.Tensor) -> float:
    try:
        if not torch.allclose(case.run_gemv(0, config).float(), want, rtol=2e-2, atol=2e-2):
            print(f'  refused {config}: output differs from fused_moe', flush=True)
            return float('inf')
        return graph_us(lambda i: case.run_gemv(i, config), layers)
    except Exception as exc:  # out of resources, or a tile the compiler refuses: the sweep goes on without it
        if not ('out of resource' in str(exc).lower() or 'OutOfResources' in type(exc).__name__):
            print(f'  refused {config}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}', flush=True)
        return float('inf')


def gemv_sweep(case: Case, a, want: torch.Tensor) -> tuple[float, dict]:
    """The few-token path's tiles: the up launch's (BLOCK_N, BLOCK_K, num_warps) with the default down tiles, then
    the down launch's (and its top-k loop unrolled or not) with the best up; at most 8K fp32 accumulators a program."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    base = moe_gemv.default_tiles(a.top_k, a.hidden, a.inter, sms)
    best = (gemv_time(case, base, a.layers, want), base)
    tiles = itertools.product((1, 2, 4, 8, 16), (128, 256, 512, 1024), (4, 8))
    grid = [(n, k, w) for n, k, w in tiles if n * k <= 8192]
    for n, k, w in grid:
        cfg = dict(up=dict(BLOCK_N=n, BLOCK_K=k, num_warps=w), down=base['down'])
        best = min(best, (gemv_time(case, cfg, a.layers, want), cfg), key=lambda b: b[0])
    up = best[1]['up']
    for (n, k, w), unroll in itertools.product(grid, sorted({1, a.top_k})):
        cfg = dict(up=up, down=dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, UNROLL=unroll))
        best = min(best, (gemv_time(case, cfg, a.layers, want), cfg), key=lambda b: b[0])
    return best


def bmm_us(a, tokens: int) -> float:
    rows = max(1, round(tokens * a.top_k / a.experts))
    x = torch.randn(a.experts, rows, a.hidden, device='cuda', dtype=torch.bfloat16)
    w_up = [torch.randn(a.experts, a.hidden, 2 * a.inter, device='cuda', dtype=torch.bfloat16) for _ in range(2)]
    w_down = [torch.randn(a.experts, a.inter, a.hidden, device='cuda', dtype=torch.bfloat16) for _ in range(2)]
    return graph_us(lambda i: torch.bmm(torch.bmm(x, w_up[i % 2])[..., :a.inter], w_down[i % 2]), 2)


def floor_us(a, case: Case, rates) -> float:
    tokens = case.x.shape[0]
    weight_bytes = case.touched * 3 * a.hidden * a.inter * 2
    flops = 2 * tokens * a.top_k * 3 * a.hidden * a.inter
    return rates.time_s(flops, weight_bytes + 4 * tokens * a.hidden) * 1e6


def same_groups(want, got, num_pairs: int) -> bool:
    """Two alignments agree: the same block experts and the same rows holding pairs (order within a run is free)."""
    return bool(torch.equal(want[1], got[1]) and torch.equal(want[0] < num_pairs, got[0] < num_pairs))


def check_align(a) -> None:
    """Triton alignment against torch's, eager and in a graph replayed with new routing; and their times."""
    for tokens in a.tokens:
        ids = torch.randn(tokens, a.experts, device='cuda').topk(a.top_k, dim=-1).indices
        for block_m in sorted({moe.row_block(tokens * a.top_k, a.experts), 16, 64}):
            ref = moe_align.align_pairs_reference(ids, a.experts, block_m)
            got = moe_align.align_pairs(ids, a.experts, block_m)
            same = same_groups(ref, got, ids.numel())
            static = ids.clone()
            graph = torch.cuda.CUDAGraph()
            moe_align.align_pairs(static, a.experts, block_m)
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                out = moe_align.align_pairs(static, a.experts, block_m)
            replay_ok = True
            for _ in range(3):
                static.copy_(torch.randn(tokens, a.experts, device='cuda').topk(a.top_k, dim=-1).indices)
                graph.replay()
                want = moe_align.align_pairs_reference(static, a.experts, block_m)
                replay_ok &= same_groups(want, out, static.numel())
            t_ref = graph_us(lambda i, m=block_m, t=ids: moe_align.align_pairs_reference(t, a.experts, m), 4)
            t_tri = graph_us(lambda i, m=block_m, t=ids: moe_align.align_pairs(t, a.experts, m), 4)
            three = ''
            if moe_align.align_form(ids.numel()) == 'one':  # the three-launch form it replaces, on the same ids
                got3 = moe_align.align_pairs(ids, a.experts, block_m, form='three')
                same &= same_groups(ref, got3, ids.numel())
                t3 = graph_us(lambda i, m=block_m, t=ids: moe_align.align_pairs(t, a.experts, m, form='three'), 4)
                def one(i, m=block_m, t=ids, w=4):
                    return moe_align.align_pairs(t, a.experts, m, num_warps=w)
                warps = ', '.join(f'{w} warps {graph_us(functools.partial(one, w=w), 4):5.1f} us' for w in (4, 8, 16))
                three = f' (one launch; three launches {t3:6.1f} us; one launch at {warps})'
            else:  # above the one program: the two- and three-launch forms on the same ids
                times = {}
                for form in ('two', 'three'):
                    got = moe_align.align_pairs(ids, a.experts, block_m, form=form)
                    same &= same_groups(ref, got, ids.numel())
                    times[form] = graph_us(lambda i, m=block_m, t=ids, f=form: moe_align.align_pairs(t, a.experts, m,
                                                                                                   form=f), 4)
                three = f' ({moe_align.align_form(ids.numel())}; two launches {times["two"]:6.1f} us, three ' \
                        f'{times["three"]:6.1f} us)'
            print(f'align T={tokens:5d} BLOCK_M={block_m:3d}: torch {t_ref:7.1f} us, triton {t_tri:6.1f} us{three}, '
                  f'equal {same}, graph replays equal {replay_ok}', flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--hidden', type=int, default=2048)
    p.add_argument('--inter', type=int, default=512, help='moe_intermediate_size')
    p.add_argument('--experts', type=int, default=64, help='experts kept (bench_real_depth --experts)')
    p.add_argument('--top-k', type=int, default=8)
    p.add_argument('--tokens', type=int, nargs='+', default=[1, 8, 32, 128, 1024, 4096, 8192])
    p.add_argument('--layers', type=int, default=6, help='weight copies rotated through')
    p.add_argument('--sweep', action=argparse.BooleanOptionalAction, default=True)
    p.add_argument('--write-config', default=None, metavar='DIR', help="write the best configs as this shape's table")
    p.add_argument('--orders', action='store_true',
                   help="also time the table's tiles (untuned without one) with the column tiles first (ORDER lines)")
    p.add_argument('--gemv', action='store_true', help='also time moe_gemv.fused_moe_gemv up to 16 tokens')
    p.add_argument('--gemv-sweep', action='store_true', help='with --gemv: also sweep its tiles (prints the best)')
    a = p.parse_args()
    rates = measure_device(torch.device('cuda'), torch.bfloat16)
    name = moe.cuda_device_name(torch.cuda.current_device())
    print(f'device {name}, commit {os.environ.get("LMDEPLOY_COMMIT", "?")}; copy '
          f'{rates.copy_bytes_per_s / 1e9:.0f} GB/s, matmul {rates.matmul_flops_per_s / 1e12:.1f} TFLOP/s; experts '
          f'{a.experts} x (H {a.hidden}, I {a.inter}), top-{a.top_k}; device us per call (CUDA graph replays)',
          flush=True)
    check_align(a)
    weights = [((torch.randn(a.experts, 2 * a.inter, a.hidden, device='cuda') / a.hidden ** 0.5).bfloat16(),
                (torch.randn(a.experts, a.hidden, a.inter, device='cuda') / a.inter ** 0.5).bfloat16())
               for _ in range(a.layers)]
    has_table = bool(moe.table_pair_counts(a.experts, a.hidden, a.inter, name))
    print('tokens | untuned us | table us | best us | best config (BLOCK_M, up, down) | floor us | bmm us | '
          'best/floor | untuned/best' + (' | gemv us | gemv/floor' if a.gemv else ''), flush=True)
    best_configs = {}
    for tokens in a.tokens:
        case = Case(a, tokens, weights)
        pairs = tokens * a.top_k
        untuned = moe.default_config(pairs, a.experts)
        want = case.run(untuned).float()
        t_untuned = try_time(case, untuned, a.layers)
        t_table = try_time(case, moe.default_config(pairs, a.experts, a.hidden, a.inter, name), a.layers, want) \
            if has_table else float('nan')
        if a.orders:  # the expert GEMMs' program order (LMDEPLOY_MOE_COLS_FIRST), on the tiles the engine runs
            tiles = moe.default_config(pairs, a.experts, a.hidden, a.inter, name) if has_table else untuned
            times = {}
            mode = moe._COLS_FIRST_MODE
            for cols_first in (False, True):
                moe._COLS_FIRST_MODE = '1' if cols_first else '0'
                times[cols_first] = try_time(case, tiles, a.layers, want)
            moe._COLS_FIRST_MODE = mode
            print(f'ORDER tokens {tokens}: {tuple(tiles)} rows first {times[False]:.1f} us, cols first '
                  f'{times[True]:.1f} us (inf: output off)', flush=True)
        t_best, cfg = sweep(case, a, untuned, want) if a.sweep else (t_untuned, untuned)
        floor, t_bmm = floor_us(a, case, rates), bmm_us(a, tokens)
        best_configs[pairs] = [cfg.block_m, list(cfg.up), list(cfg.down)]
        gemv = ''
        if a.gemv:
            t_gemv = float('nan')
            if tokens <= 16:
                got = case.run_gemv().float()
                if not torch.allclose(got, want, rtol=2e-2, atol=2e-2):
                    raise SystemExit(f'moe_gemv differs from fused_moe at {tokens} tokens: '
                                     f'{(got - want).abs().max().item():.3g}')
                t_gemv = graph_us(case.run_gemv, a.layers)
                if a.gemv_sweep:
                    t_swept, tiles = gemv_sweep(case, a, want)
                    print(f'GEMV_SWEEP tokens {tokens}: default {t_gemv:.1f} us, best {t_swept:.1f} us '
                          f'({t_swept / floor:.2f}x floor) {json.dumps(tiles)}', flush=True)
            gemv = f' | {t_gemv:7.1f} | {t_gemv / floor:5.2f}x'
        print(f'{tokens:6d} | {t_untuned:9.1f} | {t_table:8.1f} | {t_best:8.1f} | {tuple(cfg)} | {floor:7.1f} | '
              f'{t_bmm:7.1f} | {t_best / floor:5.2f}x | {t_untuned / t_best:5.2f}x{gemv}', flush=True)
    table = {'device': name, 'commit': os.environ.get('LMDEPLOY_COMMIT', '?'), 'top_k': a.top_k,
             'how': 'benchmark/bench_moe_kernel.py: best of a sweep, device time in CUDA graphs',
             'configs': {str(k): v for k, v in best_configs.items()}}
    if a.sweep:   # also printed: a device run returns logs more easily than files named with '=' and ','
        print(f'TABLE {moe.config_file_name(a.experts, a.hidden, a.inter, name)} {json.dumps(table)}')
    if a.write_config and a.sweep:
        os.makedirs(a.write_config, exist_ok=True)
        path = os.path.join(a.write_config, moe.config_file_name(a.experts, a.hidden, a.inter, name))
        with open(path, 'w') as f:
            json.dump(table, f, indent=1)
        print(f'wrote {path}')


if __name__ == '__main__':
    main()
