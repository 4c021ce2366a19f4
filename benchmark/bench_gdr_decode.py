"""One gated DeltaNet layer's token-by-token gated delta rule of a decode and a verify forward, Qwen3.5-9B heads
(16 key heads, 32 value heads, Dk = Dv = 128, bf16 inputs, float32 state pool), on the device:
- `pool`: `kernels/cuda/fused_recurrent_gated_delta.py`, pool rows updated in place (verify: cuts in the launch);
- `fla`: what the engine ran before (`LMDEPLOY_GDR_RECURRENT=fla`): pool rows gathered into a float32 copy, fla's
  `fused_recurrent_gated_delta_rule`, scattered back (verify: K + 1 such calls and a row copy after each).
Per batch, us per call and GB/s of the state bytes the op must move (every state read once and written once,
plus each verify cut written once), beside the device's copy bandwidth (a `clone` of 1 GiB); then a sweep of the
pool kernel's (block_v, num_warps). Outputs and states of the two are checked against each other first.

    python benchmark/bench_gdr_decode.py                        # ~20 s on an H200
"""
from __future__ import annotations

import argparse
import functools
import itertools

import torch
import torch.nn.functional as F
from bench_prefill_small_ops import copy_bandwidth_gbs, timed_ms


def make(batch: int, tokens: int, heads: int, k_heads: int, dim: int, num_cuts: int):
    gen = torch.Generator(device='cuda').manual_seed(batch)
    total = batch * tokens

    def r(*shape):
        return torch.randn(*shape, generator=gen, device='cuda')
    q, k = r(total, k_heads, dim).bfloat16(), r(total, k_heads, dim).bfloat16()
    v = r(total, heads, dim).bfloat16()
    g, beta = F.logsigmoid(r(total, heads) + 2.0), torch.sigmoid(r(total, heads)).bfloat16()
    num_slots = batch * (num_cuts + 1) + 1
    pool = (0.1 * r(num_slots, heads, dim, dim)).float()
    order = torch.randperm(num_slots - 1, generator=torch.Generator().manual_seed(0)).cuda() + 1
    ids, cuts = order[:batch], order[batch:].view(batch, num_cuts) if num_cuts else None
    cu = torch.arange(batch + 1, device='cuda') * tokens
    return [q, k, v, g, beta], cu, pool, ids, torch.zeros(batch, dtype=torch.bool, device='cuda'), cuts


def fla_rounds(inputs, cu, pool, ids, fresh, cuts):
    """The engine's former verify: one gathered fla call per token, a row copy after each."""
    from lmdeploy.pytorch.kernels.cuda.gated_delta_rule import recurrent_gated_delta_rule
    if cuts is None:
        return recurrent_gated_delta_rule(*inputs, cu, pool, ids, fresh)
    batch, rows = ids.numel(), cuts.shape[1] + 1
    one = torch.arange(batch + 1, device='cuda')
    outs = []
    for t in range(rows):
        token = [x.unflatten(0, (batch, rows))[:, t].contiguous() for x in inputs]
        outs.append(recurrent_gated_delta_rule(*token, one, pool, ids, fresh if t == 0 else torch.zeros_like(fresh)))
        if t < rows - 1:
            pool[cuts[:, t]] = pool[ids]
    return torch.stack(outs, 1).flatten(0, 1)


def bench_one(batch: int, num_cuts: int, iters: int, peak: float) -> None:
    from lmdeploy.pytorch.kernels.cuda.fused_recurrent_gated_delta import fused_recurrent_gated_delta_rule as pool_fn
    heads, k_heads, dim = 32, 16, 128
    inputs, cu, pool, ids, fresh, cuts = make(batch, num_cuts + 1, heads, k_heads, dim, num_cuts)
    p2 = pool.clone()
    a = pool_fn(*inputs, cu, pool, ids, fresh, cut_slots=cuts)
    b = fla_rounds(inputs, cu, p2, ids, fresh, cuts)
    err_o, err_s = (a.float() - b.float()).abs().max().item(), (pool - p2).abs().max().item()
    state_bytes = batch * heads * dim * dim * 4 * (2 + num_cuts)
    ms_pool = timed_ms(functools.partial(pool_fn, *inputs, cu, pool, ids, fresh, cut_slots=cuts), iters)
    ms_fla = timed_ms(functools.partial(fla_rounds, inputs, cu, p2, ids, fresh, cuts), iters)
    kind = f'verify K={num_cuts}' if num_cuts else 'decode'
    print(f'batch {batch:4d} {kind:11s} pool {ms_pool * 1e3:8.1f} us ({state_bytes / ms_pool / 1e6 / peak:4.0%} of '
          f'copy, floor {state_bytes / peak / 1e3:7.1f} us)  fla {ms_fla * 1e3:8.1f} us  x{ms_fla / ms_pool:5.2f}  '
          f'max err out {err_o:.1e} state {err_s:.1e}')
    sweep = []
    for block_v, warps in itertools.product((16, 32, 64), (1, 2, 4, 8)):
        ms = timed_ms(functools.partial(pool_fn, *inputs, cu, pool, ids, fresh, cut_slots=cuts, block_v=block_v,
                                        num_warps=warps), iters)
        sweep.append((ms, block_v, warps))
    print('    sweep (us, block_v, warps), best first: ' +
          ' '.join(f'{ms * 1e3:.1f}/{bv}/{w}' for ms, bv, w in sorted(sweep)[:6]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--batches', type=int, nargs='+', default=[1, 32, 128])
    parser.add_argument('--draft-tokens', type=int, default=3, help='K of the verify rows (K + 1 tokens a row)')
    parser.add_argument('--iters', type=int, default=20)
    args = parser.parse_args()
    peak = copy_bandwidth_gbs()
    print(f'{torch.cuda.get_device_name()}: one layer, 16/32 heads, D 128, float32 states, copy bandwidth '
          f'{peak:.0f} GB/s; floor = state bytes / copy bandwidth')
    for batch, num_cuts in itertools.product(args.batches, (0, args.draft_tokens)):
        bench_one(batch, num_cuts, args.iters, peak)


if __name__ == '__main__':
    main()
