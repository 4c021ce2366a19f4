"""Bandwidth of the Triton `copy_packed_cache` against a plain device-to-device copy and the torch fallback.

Realistic shape: 48 attention layers, 64-token scheduler blocks, bf16 K/V of 2 kv heads x 256 head_dim, as one packed
pool `[layers, num_pages, page_bytes]` with `page_bytes = 2 * kbs * 2 * 256 * 2`; kernel_block_size 64 (one page per
block) and 16 (four pages per block). A plan of N pairs moves `N * layers * block_bytes` bytes; bandwidth counts
them twice (read + write). The D2D baseline is `dst.copy_(src)` of two contiguous buffers of that size.

    python benchmark/bench_copy_packed_cache.py [--pairs 8] [--iters 200]

Prints a table and, last, one JSON line.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from lmdeploy.pytorch.kernels.cuda.copy_packed_cache import copy_packed_cache
from lmdeploy.pytorch.kernels.default.cache_copy import copy_packed_cache as torch_copy_packed_cache


def time_ms(fn: Callable[[], None], warmup: int, iters: int, graph: bool = True, per_graph: int = 20) -> float:
    """Mean device milliseconds per call. With `graph`, `per_graph` calls are captured in one CUDA graph and its
    replays are timed with CUDA events, so only device time counts: one Triton launch can take longer on the host
    than this copy takes on the device, and back-to-back eager launches then time the host (the engine launches a
    copy plan once per forward, behind the forward's other work). Without `graph`: events around `iters`
    back-to-back eager calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    reps = iters
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(per_graph):
                fn()
        g.replay()
        torch.cuda.synchronize()
        reps = max(1, iters // per_graph)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay() if graph else fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (reps * per_graph if graph else reps)


def make_plan(num_blocks: int, num_pairs: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random distinct blocks spread over the pool: sources and destinations are unique and disjoint."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(num_blocks, generator=gen)[:2 * num_pairs]
    return blocks[:num_pairs].cuda(), blocks[num_pairs:].cuda()


def bench_one(args: argparse.Namespace, kernel_block_size: int) -> dict:
    pages_per_block = args.block_size // kernel_block_size
    page_bytes = 2 * kernel_block_size * args.num_kv_heads * args.head_dim * 2  # bf16
    block_bytes = pages_per_block * page_bytes
    pool = torch.randint(0, 256, (args.layers, args.num_blocks * pages_per_block, page_bytes), dtype=torch.uint8,
                         device='cuda')
    src, dst = make_plan(args.num_blocks, args.pairs, seed=kernel_block_size)

    expected = pool.clone()
    torch_copy_packed_cache(expected, src, dst, pages_per_block)
    copy_packed_cache(pool, src, dst, pages_per_block, debug=True)
    assert torch.equal(pool, expected), 'copy_packed_cache disagrees with the torch reference'
    del expected

    copied = args.pairs * args.layers * block_bytes
    flat_src = torch.empty(copied, dtype=torch.uint8, device='cuda')
    flat_dst = torch.empty_like(flat_src)
    impls = {
        'd2d_copy': lambda: flat_dst.copy_(flat_src),
        'triton': lambda: copy_packed_cache(pool, src, dst, pages_per_block),
        'torch_fallback': lambda: torch_copy_packed_cache(pool, src, dst, pages_per_block),
    }
    timings = {name: time_ms(fn, args.warmup, args.iters) for name, fn in impls.items()}
    eager = {name: time_ms(fn, args.warmup, args.iters, graph=False) for name, fn in impls.items()}
    # Launch-shape sweep (bytes per program, warps): printed so the default can be chosen from data.
    for chunk, warps in ((16384, 8), (32768, 8), (65536, 8), (65536, 16), (131072, 16), (262144, 32)):
        ms = time_ms(lambda c=chunk, w=warps: copy_packed_cache(pool, src, dst, pages_per_block, chunk_bytes=c,
                                                                num_warps=w), args.warmup, args.iters)
        print(f'  sweep kbs={kernel_block_size} chunk={chunk} warps={warps}: {ms:.4f} ms '
              f'({2 * copied / (ms * 1e-3) / 1e9:.1f} GB/s)')
    gbps = {name: 2 * copied / (ms * 1e-3) / 1e9 for name, ms in timings.items()}
    return dict(kernel_block_size=kernel_block_size, pages_per_block=pages_per_block, page_bytes=page_bytes,
                pairs=args.pairs, layers=args.layers, bytes_copied=copied,
                ms={k: round(v, 5) for k, v in timings.items()}, gbps={k: round(v, 1) for k, v in gbps.items()},
                eager_ms={k: round(v, 5) for k, v in eager.items()},
                pct_of_d2d={k: round(100 * v / gbps['d2d_copy'], 1) for k, v in gbps.items()})


def print_table(results: list[dict]) -> None:
    print('device time from CUDA-graph replays; "eager ms": back-to-back eager launches (host launch time included)')
    print(f'{"kbs":>4} {"ppb":>4} {"MiB":>8} {"impl":>15} {"ms":>9} {"GB/s":>8} {"% d2d":>7} {"eager ms":>9}')
    for r in results:
        for impl in ('d2d_copy', 'triton', 'torch_fallback'):
            print(f'{r["kernel_block_size"]:>4} {r["pages_per_block"]:>4} {r["bytes_copied"] / 2**20:>8.1f} '
                  f'{impl:>15} {r["ms"][impl]:>9.4f} {r["gbps"][impl]:>8.1f} {r["pct_of_d2d"][impl]:>7.1f} '
                  f'{r["eager_ms"][impl]:>9.4f}')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--layers', type=int, default=48)
    parser.add_argument('--block-size', type=int, default=64, help='scheduler block size in tokens')
    parser.add_argument('--kernel-block-sizes', type=int, nargs='+', default=[64, 16])
    parser.add_argument('--num-kv-heads', type=int, default=2)
    parser.add_argument('--head-dim', type=int, default=256)
    parser.add_argument('--pairs', type=int, default=8)
    parser.add_argument('--num-blocks', type=int, default=256, help='blocks in the pool')
    parser.add_argument('--warmup', type=int, default=20)
    parser.add_argument('--iters', type=int, default=200)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit('bench_copy_packed_cache needs a CUDA device')
    results = []
    for kbs in args.kernel_block_sizes:
        results.append(bench_one(args, kbs))
        torch.cuda.empty_cache()  # the pool of one size is gone before the next is allocated
    device = torch.cuda.get_device_name()
    print(f'device: {device}')
    print_table(results)
    print(json.dumps(dict(bench='copy_packed_cache', device=device, results=results)))


if __name__ == '__main__':
    main()
