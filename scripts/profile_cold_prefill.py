"""Where a cold long prompt's extra time goes with the prefix cache on (in-prefill checkpoints on vs off).

On the H200 a cold 16K-token prompt of the Qwen3-Next-shaped model took ~13 ms longer with the prefix cache on and
its default in-prefill checkpoints (two cuts: two more gated-delta-rule rounds per layer) than off, and ~1 ms
longer with the in-prefill interval at 0 (docs/benchmarks.md has the attribution this script made: stream
synchronisations first, then the extra kernel calls' host time). For each configuration (cache off;
cache on; cache on without in-prefill checkpoints) this script prints the median time to the first token over a
few new prompts, then profiles one more: torch.profiler's top ops by device time and by host time, the number of
host-device synchronisations, and the gaps where the device sat idle.

    python3 scripts/profile_cold_prefill.py [--tokens 16384] [--out DIR]            # on the GPU
    python3 scripts/profile_cold_prefill.py --smoke                                 # a CPU dry run (tiny model)
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'benchmark'))


def build_if_missing(model_dir: str, smoke: bool) -> None:
    import bench_vs_transformers as bvt
    config = bvt.SMOKE_CONFIG if smoke else bvt.FULL_CONFIG
    if bvt._reusable(model_dir, config):
        return
    bench = bvt.Bench(bvt.parse_args(['--model-dir', model_dir] + (['--smoke'] if smoke else [])))
    model = bvt.build_checkpoint(bench, config, torch.float32 if smoke else torch.bfloat16)
    del model
    gc.collect()


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (n,), generator=g).tolist()


def sync(device: str) -> None:
    if device == 'cuda':
        torch.cuda.synchronize()


def first_token_ms(engine, tokens: list[int], device: str) -> float:
    from lmdeploy.pytorch.messages import SamplingParams
    got = []
    sync(device)
    t = time.perf_counter()
    engine.add_request(tokens, SamplingParams(max_new_tokens=1),
                       callback=lambda o: got.append(time.perf_counter()) if o.new_token_ids else None)
    engine.run_until_idle()
    return (got[0] - t) * 1e3


def idle_ms(prof) -> float:
    """Total gap between consecutive device kernels over the profiled span (the device waiting for the host)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    idle, end = 0.0, None
    for start, stop in spans:
        if end is not None and start > end:
            idle += start - end
        end = stop if end is None else max(end, stop)
    return idle / 1e3  # us -> ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--smoke', action='store_true')
    p.add_argument('--model-dir', default=None)
    p.add_argument('--tokens', type=int, default=None)
    p.add_argument('--reps', type=int, default=5)
    p.add_argument('--out', default=None, help='folder for profile_cold_prefill.txt (default: stdout only)')
    args = p.parse_args()
    device = 'cpu' if args.smoke else 'cuda'
    model_dir = args.model_dir or ('/tmp/qwen3next_bench_smoke' if args.smoke else '/tmp/qwen3next_bench')
    tokens = args.tokens or (512 if args.smoke else 16384)
    build_if_missing(model_dir, args.smoke)
    out = sys.stdout
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        out = open(os.path.join(args.out, 'profile_cold_prefill.txt'), 'w')

    from lmdeploy.messages import PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine
    interval = max(64, tokens // 4)
    configs = [('cache off', dict()),
               ('cache on', dict(enable_prefix_caching=True, prefix_cache_prefill_state_interval=interval)),
               ('cache on, no in-prefill', dict(enable_prefix_caching=True, prefix_cache_prefill_state_interval=0))]
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == 'cuda':
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    for name, extra in configs:
        engine = Engine(model_dir, PytorchEngineConfig(
            device_type=device, dtype='float32' if args.smoke else 'bfloat16', block_size=64,
            cache_max_entry_count=0.3, max_batch_size=64, max_prefill_token_num=tokens, session_len=tokens + 64,
            **extra))
        first_token_ms(engine, prompt(tokens, 0), device)  # warm-up: compile every kernel at these shapes
        times = [first_token_ms(engine, prompt(tokens, 1 + i), device) for i in range(args.reps)]
        live = engine.stats_snapshot.prefix_cache.live_checkpoints
        print(f'[{name}] first token of a cold {tokens}-token prompt: median {statistics.median(times):.2f} ms '
              f'(all: {", ".join(f"{t:.1f}" for t in times)}); live checkpoints {live}', file=out, flush=True)
        with torch.profiler.profile(activities=activities) as prof:
            first_token_ms(engine, prompt(tokens, 100), device)
        events = prof.key_averages()
        syncs = sum(e.count for e in events
                    if 'Synchronize' in e.key or e.key in ('aten::item', 'aten::_local_scalar_dense'))
        print(f'[{name}] host-device synchronisations (cudaStreamSynchronize / item / ...): {syncs}', file=out)
        if device == 'cuda':
            print(f'[{name}] device idle between kernels: {idle_ms(prof):.2f} ms', file=out)
        sort = 'device_time_total' if device == 'cuda' else 'cpu_time_total'
        print(f'[{name}] top ops by {sort}:', file=out)
        print(events.table(sort_by=sort, row_limit=20), file=out)
        print(f'[{name}] top ops by self host time:', file=out)
        print(events.table(sort_by='self_cpu_time_total', row_limit=20), file=out, flush=True)
        del engine
        gc.collect()
        if device == 'cuda':
            torch.cuda.empty_cache()


if __name__ == '__main__':
    main()
