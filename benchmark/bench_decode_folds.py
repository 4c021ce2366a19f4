"""Device time of the decode launch folds against the launches they replace, each as the chain of kernels a decode
layer runs, from CUDA-graph replays (`graph_timing.graph_us`: no host launch cost; programmatic dependent launch as
the engine launches them, unless `LMDEPLOY_PDL=0`):

- `route`: a MoE layer's post-attention norm, its router's GEMV over the stacked router + shared-gate rows and the
  softmax top-k: the `cuda` backend's three launches (`_norm_then_route`: add + RMSNorm, the one-row GEMV or
  cuBLAS, `softmax_topk`) against `moe_routing.norm_route` (one launch, `LMDEPLOY_NORM_ROUTE=1` in the engine), at
  1 to 4 tokens, the 35B-A3B shape (hidden 2048, 64 or 256 experts, top-8) and the 80B's (512 experts, top-10);
- `out_norm`: gated DeltaNet's recurrent rule with its folded gating, then the gated output norm
  (`rms_norm_rows.gated_rms_norm`), against the rule with the norm folded in (`out_norm`, `LMDEPLOY_FOLD_OUT_NORM=1`
  in the engine), Qwen3.5 heads (16 key, 32 value, 128 x 128, float32 state pool), at batch 1, 32 and 128.

Each chain runs `--copies` times per graph replay on distinct inputs, weights and pool rows, so no call reads
another's weights or states from L2. The two forms' outputs are compared first (max abs difference: routing ids
must agree; float results within a rounding). Prints one line per (chain, shape): us per call of each form and
the ratio. The engine-level A/B is `bench_real_depth.py --rows decode` with the switches; this isolates the kernels.

    python benchmark/bench_decode_folds.py                      # ~20 s on an H200
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from graph_timing import graph_us  # noqa: E402


def route_case(tokens: int, experts: int, top_k: int, copies: int, hidden: int = 2048):
    """(fused(i), unfused(i)) over `copies` sets of inputs of one MoE layer's router head."""
    from lmdeploy.pytorch.backends import cuda as backend
    from lmdeploy.pytorch.kernels.cuda.moe_routing import norm_route
    gen = torch.Generator(device='cuda').manual_seed(tokens * 1000 + experts)

    def r(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, device='cuda')).bfloat16()
    xs = [r(tokens, hidden) for _ in range(copies)]
    res = [r(tokens, hidden) for _ in range(copies)]
    rows = [r(experts + 1, hidden, scale=hidden ** -0.5) for _ in range(copies)]
    norm_w = r(hidden, scale=0.1)
    args = (1e-6, True)

    def fused(i):
        return norm_route(xs[i], res[i], norm_w, *args, rows[i], top_k, True, True)

    def unfused(i):
        return backend._norm_then_route(xs[i], res[i], norm_w, *args, rows[i], top_k, True, True)
    return fused, unfused


def out_norm_case(batch: int, copies: int, heads: int = 32, k_heads: int = 16, dim: int = 128):
    """(fused(i), unfused(i)) over `copies` sets of one recurrent layer's decode inputs and pool rows."""
    from lmdeploy.pytorch.kernels.cuda.fused_recurrent_gated_delta import fused_recurrent_gated_delta_rule as rule
    from lmdeploy.pytorch.kernels.cuda.rms_norm_rows import gated_rms_norm
    gen = torch.Generator(device='cuda').manual_seed(batch)

    def r(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, device='cuda')).bfloat16()
    sets = []
    pool = (0.1 * torch.randn(copies * batch, heads, dim, dim, generator=gen, device='cuda')).float()
    pools = [pool.clone(), pool]          # the two forms update their own copy of the rows
    for i in range(copies):
        q, k, v = r(batch, k_heads, dim), r(batch, k_heads, dim), r(batch, heads, dim)
        a, b, z = r(batch, heads), r(batch, heads), r(batch, heads, dim)
        ids = torch.arange(i * batch, (i + 1) * batch, device='cuda')
        sets.append((q, k, v, a, b, z, ids))
    cu = torch.arange(batch + 1, device='cuda')
    fresh = torch.zeros(batch, dtype=torch.bool, device='cuda')
    a_log, dt_bias = r(heads).float(), r(heads).float()
    norm_w = r(dim, scale=0.1) + 1.0

    def call(i, which, fold):
        q, k, v, a, b, z, ids = sets[i]
        out = rule(q, k, v, a, b, cu, pools[which], ids, fresh, gating_params=(a_log, dt_bias),
                   out_norm=(z, norm_w, 1e-6) if fold else None)
        return out if fold else gated_rms_norm(out, z, norm_w, 1e-6)
    return (lambda i: call(i, 0, True)), (lambda i: call(i, 1, False))


def max_diff(a, b) -> float:
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


def measure(name: str, shape: str, fused, unfused, copies: int) -> None:
    diff = max_diff(fused(0), unfused(0))
    t_fused, t_unfused = graph_us(fused, copies), graph_us(unfused, copies)
    print(f'{name:9s} {shape:28s} unfused {t_unfused:7.2f} us  fused {t_fused:7.2f} us  '
          f'fused/unfused {t_fused / t_unfused:5.2f}  max diff {diff:.2e}', flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--copies', type=int, default=8, help='chains per graph replay, on distinct data')
    parser.add_argument('--tokens', type=int, nargs='+', default=[1, 2, 4])
    parser.add_argument('--batches', type=int, nargs='+', default=[1, 32, 128])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit('needs a CUDA device')
    print(f'device: {torch.cuda.get_device_name()}; torch {torch.__version__}; PDL '
          f"{'off' if os.environ.get('LMDEPLOY_PDL') == '0' else 'on (capability >= 9)'}")
    for experts, top_k in ((64, 8), (256, 8), (512, 10)):
        for tokens in args.tokens:
            measure('route', f'T{tokens} E{experts} top{top_k} H2048', *route_case(tokens, experts, top_k,
                                                                                    args.copies), args.copies)
    for batch in args.batches:
        measure('out_norm', f'B{batch} 32/16 heads 128x128', *out_norm_case(batch, args.copies), args.copies)


if __name__ == '__main__':
    main()
