"""The gated DeltaNet's causal conv1d on the device (`kernels/cuda/causal_conv1d.py`, `causal_conv1d_planes`: the
prefill call every recurrent layer makes), against its floor, per token count, with the token-parallel kernel's
tiles swept.

Shape: the conv channels of all three real-depth shapes (Qwen3.5-9B / -35B-A3B, Qwen3-Next-80B: 16 key heads and
32 value heads of 128, 8,192 channels, width 4) stored as q / k / v planes (2,048 / 2,048 / 4,096), the input a
column slice of the fused input projection's output (rows of 16,384 elements), one sequence: a cold prompt
(fresh: no history read), and with `--suffix N` a suffix of N tokens after a stored history. Device time from CUDA
graph replays (`graph_timing.graph_us`); floor = (input read + output written) / the copy rate measured here
(`real_depth_floors.measure_device`). Two store forms of the token-parallel kernel: the per-column plane layout
(`LMDEPLOY_CONV_VECTOR_STORES=0`) and the vector stores through one plane's row stride (the default,
`causal_conv1d.VECTOR_STORES`), each with the token-parallel kernel reading the history
(`LMDEPLOY_CONV_SPLIT_HISTORY=0`) and without it (the default, `causal_conv1d.SPLIT_HISTORY`: the per-sequence kernel
writes the outputs that need it); each of the four forms at the default tiles and at the best of its own sweep.
Every output is checked against the first form's (exact: the forms and tiles change which program writes an element
and how, not its arithmetic), and that one against the torch reference (`kernels/default/causal_conv1d.py`).

    python benchmark/bench_conv1d.py                              # 1K / 8K / 32K cold + a 100-token suffix
    python benchmark/bench_conv1d.py --tokens 1024 --no-sweep     # the four forms, default tiles only
"""
from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from graph_timing import graph_us  # noqa: E402
from real_depth_floors import measure_device  # noqa: E402

from lmdeploy.pytorch.kernels.cuda import causal_conv1d as conv  # noqa: E402
from lmdeploy.pytorch.kernels.default import causal_conv1d as ref_conv  # noqa: E402

SPLITS = (2048, 2048, 4096)
ROW = 16384


def make_case(tokens: int, fresh: bool, gen: torch.Generator):
    channels = sum(SPLITS)
    wide = torch.randn(tokens, ROW, device='cuda', generator=gen).bfloat16()
    x = wide[:, :channels]
    weight = torch.randn(channels, 4, device='cuda', generator=gen).bfloat16()
    pool = torch.randn(4, channels, 3, device='cuda', generator=gen).bfloat16()
    ids = torch.tensor([2], device='cuda')
    is_fresh = torch.tensor([fresh], device='cuda')
    cu = torch.tensor([0, tokens], device='cuda')
    return x, weight, pool, ids, is_fresh, cu


def planes(case, pool: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x, weight, _, ids, is_fresh, cu = case
    return conv.causal_conv1d_planes(x, weight, None, pool, ids, is_fresh, cu, SPLITS, 'silu')


def run(case, pool: torch.Tensor) -> torch.Tensor:
    return torch.cat(planes(case, pool), dim=1)


def configured(tiles, form: tuple[bool, bool], fn):
    """fn() with the kernel's tiles (None: the default) and form (vector stores, split history) set, restored
    after."""
    conv.TOKEN_TILES, (conv.VECTOR_STORES, conv.SPLIT_HISTORY) = tiles, form
    try:
        return fn()
    finally:
        conv.TOKEN_TILES, conv.VECTOR_STORES, conv.SPLIT_HISTORY = None, False, False


def check_and_time(case, tiles, form: tuple[bool, bool], want: torch.Tensor) -> float:
    pool = case[2].clone()
    if not configured(tiles, form, lambda: torch.equal(run(case, case[2].clone()), want)):
        raise SystemExit(f'tiles {tiles}, form {form}: the output changed ({case[0].shape[0]} tokens)')
    return configured(tiles, form, lambda: graph_us(lambda i: planes(case, pool), 1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--tokens', type=int, nargs='+', default=[1024, 8192, 32768], help='cold prompts')
    p.add_argument('--suffix', type=int, nargs='*', default=[100], help='suffixes after a stored history')
    p.add_argument('--sweep', action=argparse.BooleanOptionalAction, default=True)
    a = p.parse_args()
    rates = measure_device(torch.device('cuda'), torch.bfloat16)
    print(f'device {torch.cuda.get_device_name()}, commit {os.environ.get("LMDEPLOY_COMMIT", "?")}; copy '
          f'{rates.copy_bytes_per_s / 1e9:.0f} GB/s; conv {sum(SPLITS)} channels {SPLITS}, width 4, bf16; device us '
          'per call (CUDA graph replays)', flush=True)
    forms = {'plane': (False, False), 'vector': (True, False), 'plane, split history': (False, True),
             'vector, split history': (True, True)}
    print('case | floor us | ' + ' | '.join(f'{f} us (default tiles / best)' for f in forms)
          + ' | best form | best/floor', flush=True)
    gen = torch.Generator(device='cuda').manual_seed(0)
    for tokens, fresh in [(t, True) for t in a.tokens] + [(t, False) for t in a.suffix]:
        case = make_case(tokens, fresh, gen)
        x, weight, pool, ids, is_fresh, cu = case
        want = configured(None, (False, False), functools.partial(run, case, pool.clone()))
        ref = ref_conv.causal_conv1d(x.float(), weight.float(), None, pool.float(), ids, is_fresh, cu, 'silu')
        if not torch.allclose(want.float(), ref, rtol=2e-2, atol=2e-2):
            raise SystemExit(f'{tokens} tokens: the Triton conv differs from the torch reference by '
                             f'{(want.float() - ref).abs().max().item():.3g}')
        floor = 2 * tokens * sum(SPLITS) * 2 / rates.copy_bytes_per_s * 1e6
        cells, best = [], (float('inf'), '')
        for form, flags in forms.items():
            default = check_and_time(case, None, flags, want)
            mine = (default, None)
            if a.sweep:
                for tiles in itertools.product((8, 16, 32), (64, 128), (2, 4)):
                    mine = min(mine, (check_and_time(case, tiles, flags, want), tiles), key=lambda b: b[0])
            cells.append(f'{default:7.1f} / {mine[0]:7.1f} {mine[1] or "(default)"}')
            best = min(best, (mine[0], f'{form} {mine[1] or "(default)"}'), key=lambda b: b[0])
        name = f'{tokens} {"cold" if fresh else "after history"}'
        print(f'{name} | {floor:7.1f} | ' + ' | '.join(cells) + f' | {best[1]} | {best[0] / floor:5.2f}x', flush=True)

if __name__ == '__main__':
    main()
