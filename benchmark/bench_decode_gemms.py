"""Each dense linear of a real-depth shape alone, at decode batch sizes: how much of the copy rate cuBLAS reaches.

The engine's model for `--shape` (the shapes of `bench_real_depth.py`) is built on the meta device and its 2-D
linear weights are grouped by (out, in) shape, with how many a forward runs (the head once; the router and the
shared-expert gate are linears too; the experts' 3-D weights are `bench_moe_kernel.py`'s). For each shape and
batch: `F.linear(x, W)` (the engine's call, W stored [out, in]) and `x @ Wt` (the same product with the weight
stored transposed, [in, out]: cuBLAS picks other kernels for that layout), device time per call from a CUDA graph
of calls over enough weight copies that none is read from L2 twice; GB/s of the weight bytes and the share of the
copy rate (`real_depth_floors.measure_device`). The last lines sum count x time per forward against the weights'
floor, so the table says which projections lose the decode step's GEMM time. At batch 1 the Triton GEMV
(`kernels/cuda/gemv.py`, the `cuda` backend's default for one row) is timed beside cuBLAS, with its default tiles and,
with `--gemv-sweep`, the best of BLOCK_N x BLOCK_K x warps (printed, to tune `gemv_config`).

    python benchmark/bench_decode_gemms.py --shape qwen3.5-35b-a3b          # ~1 minute on an H200
    python benchmark/bench_decode_gemms.py --shape qwen3.5-9b --batches 1 32 128
    python benchmark/bench_decode_gemms.py --shape qwen3.5-9b --batches 1 --gemv-sweep
    python benchmark/bench_decode_gemms.py --smoke                          # tiny shape on the CPU: the grouping
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_real_depth import SHAPES, make_config  # noqa: E402
from graph_timing import graph_us  # noqa: E402
from real_depth_floors import measure_device  # noqa: E402

_L2_BYTES = 200 * 2**20  # weight copies per shape span at least this (the H200's L2 is 50 MiB)


def linear_shapes(args) -> list[tuple[tuple[int, int], int, list[str]]]:
    """((out, in), linears per forward, example module names) of the engine model's 2-D linear weights."""
    from lmdeploy.pytorch.models.model_init import params_on_meta
    from lmdeploy.pytorch.models.registry import get_model_class
    config, model_name, _ = make_config(args)
    with params_on_meta():
        model = get_model_class(model_name)(config)
    from lmdeploy.pytorch.nn.linear import Linear
    from lmdeploy.pytorch.nn.moe import TopKRouter
    groups = collections.defaultdict(list)
    for name, module in model.named_modules():
        weight = getattr(module, 'weight', None)
        if isinstance(module, (Linear, TopKRouter, torch.nn.Linear)) and weight is not None and weight.dim() == 2:
            groups[tuple(weight.shape)].append(name)
    return sorted(((shape, len(names), names[:2]) for shape, names in groups.items()), key=lambda g: -g[0][0] * g[0][1])


def time_shape(out_f: int, in_f: int, batch: int, rates, sweep: bool = False) -> tuple[float, ...]:
    """(F.linear us, x @ Wt us, floor us, Triton GEMV us, its best config's us, that config) of one [out_f, in_f]
    bf16 weight at `batch` rows (the GEMV figures at batch 1 only, else nan / None)."""
    from lmdeploy.pytorch.kernels.cuda.gemv import gemv
    nbytes = out_f * in_f * 2
    copies = max(2, -(-_L2_BYTES // nbytes))
    ws = [torch.randn(out_f, in_f, device='cuda', dtype=torch.bfloat16) for _ in range(copies)]
    wts = [w.t().contiguous() for w in ws]
    x = torch.randn(batch, in_f, device='cuda', dtype=torch.bfloat16)
    t_lin = graph_us(lambda i: F.linear(x, ws[i % copies]), copies)
    t_wt = graph_us(lambda i: x @ wts[i % copies], copies)
    t_gemv = t_best = float('nan')
    best = None
    if batch == 1:
        t_gemv = t_best = graph_us(lambda i: gemv(x, ws[i % copies]), copies)
        for cfg in (GEMV_SWEEP if sweep else []):
            t = graph_us(lambda i, cfg=cfg: gemv(x, ws[i % copies], config=cfg), copies)
            if t < t_best:
                t_best, best = t, cfg
    return t_lin, t_wt, rates.time_s(2 * batch * out_f * in_f, nbytes) * 1e6, t_gemv, t_best, best


GEMV_SWEEP = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w) for n in (1, 2, 4, 8, 16) for k in (256, 512, 1024)
              for w in (4, 8)]


def main(argv: list[str] | None = None) -> list:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--shape', choices=sorted(SHAPES), default='qwen3.5-35b-a3b')
    p.add_argument('--experts', type=int, default=64, help='experts kept of the MoE shapes (as bench_real_depth)')
    p.add_argument('--batches', type=int, nargs='+', default=[1, 128])
    p.add_argument('--smoke', action='store_true', help='tiny shape, no device: print the grouping only')
    p.add_argument('--gemv-sweep', action='store_true', help='batch 1: sweep the Triton GEMV tiles')
    args = p.parse_args(argv)
    groups = linear_shapes(args)
    print(f'{args.shape}: {len(groups)} linear shapes, {sum(n for _, n, _ in groups)} linears per forward')
    for (out_f, in_f), count, names in groups:
        print(f'  [{out_f} x {in_f}] x {count}: {", ".join(names)}')
    if args.smoke or not torch.cuda.is_available():
        return groups
    rates = measure_device(torch.device('cuda'), torch.bfloat16)
    copy = rates.copy_bytes_per_s
    print(f'device {torch.cuda.get_device_name()}, commit {os.environ.get("LMDEPLOY_COMMIT", "?")}; copy '
          f'{copy / 1e9:.0f} GB/s; bf16; device us per call (CUDA graph replays)')
    for batch in args.batches:
        print(f'\nbatch {batch}\n| weight [out x in] | per forward | F.linear us | GB/s | of copy | x @ Wt us | '
              f'of copy | Triton GEMV us | of copy | best GEMV us (tiles) | floor us |\n'
              f'|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|')
        total = {'linear': 0.0, 'wt': 0.0, 'gemv': 0.0, 'best': 0.0, 'floor': 0.0}
        for (out_f, in_f), count, _ in groups:
            t_lin, t_wt, floor, t_gemv, t_best, best = time_shape(out_f, in_f, batch, rates, args.gemv_sweep)
            for key, value in (('linear', t_lin), ('wt', t_wt), ('gemv', t_gemv), ('best', t_best),
                               ('floor', floor)):
                total[key] += count * value
            lin, wt, gv = (out_f * in_f * 2 / (t * 1e-6) / copy for t in (t_lin, t_wt, t_gemv))
            tiles = 'default' if best is None else 'N{BLOCK_N} K{BLOCK_K} w{num_warps}'.format(**best)
            print(f'| {out_f} x {in_f} | {count} | {t_lin:.1f} | {lin * copy / 1e9:.0f} | {lin:.0%} | {t_wt:.1f} | '
                  f'{wt:.0%} | {t_gemv:.1f} | {gv:.0%} | {t_best:.1f} ({tiles}) | {floor:.1f} |')
        print(f'per forward: F.linear {total["linear"] / 1e3:.3f} ms, x @ Wt {total["wt"] / 1e3:.3f} ms, Triton GEMV '
              f'{total["gemv"] / 1e3:.3f} ms (best tiles {total["best"] / 1e3:.3f}), floor {total["floor"] / 1e3:.3f} '
              f'ms ({total["floor"] / total["linear"]:.0%} / {total["floor"] / total["wt"]:.0%} of it)', flush=True)
    return groups


if __name__ == '__main__':
    main()
