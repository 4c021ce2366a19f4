"""Where an engine step's time goes, on the Qwen3-Next-shaped model of `benchmark/bench_vs_transformers.py`.

For each mode (eager, CUDA graphs): median wall time of a decode step at batch 1 and 64 and of a 1K-token prefill
step, then a cProfile of decode steps (host time by function) and a torch.profiler summary of device time, so the
host-bound share of a step is visible.

    python3 scripts/profile_step.py [--model-dir /tmp/qwen3next_bench] [--modes eager graph] [--out DIR]

Builds the checkpoint (random bf16 weights) if the folder does not hold one. Diagnostic only; numbers for the docs
come from benchmark/.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'benchmark'))


def build_if_missing(model_dir: str) -> None:
    import bench_vs_transformers as bvt
    if bvt._reusable(model_dir, bvt.FULL_CONFIG):
        return
    args = bvt.parse_args(['--model-dir', model_dir])
    bench = bvt.Bench(args)
    model = bvt.build_checkpoint(bench, bvt.FULL_CONFIG, torch.bfloat16)
    del model
    gc.collect()
    torch.cuda.empty_cache()


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 150000, (n,), generator=g).tolist()


def step_times(engine, prompts: list[list[int]], new_tokens: int) -> tuple[list[float], list[float]]:
    """(prefill step times, pure-decode step times) in ms for one batch run to completion."""
    from lmdeploy.pytorch.messages import SamplingParams
    params = SamplingParams(max_new_tokens=new_tokens, min_new_tokens=new_tokens, stop_token_ids=())
    for p in prompts:
        engine.add_request(p, params)
    prefill, decode = [], []
    while engine.has_work:
        running = engine.scheduler.running
        is_decode = bool(running) and all(s.num_computed == s.num_tokens - 1 for s in running) \
            and not engine.scheduler.waiting
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        (decode if is_decode else prefill).append((time.perf_counter() - t) * 1e3)
    return prefill, decode


def med(xs: list[float]) -> str:
    return f'{statistics.median(xs):.2f}' if xs else 'n/a'


def profile_mode(model_dir: str, eager: bool, out) -> None:
    from lmdeploy.messages import PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine
    name = 'eager' if eager else 'graph'
    t = time.perf_counter()
    engine = Engine(model_dir, PytorchEngineConfig(device_type='cuda', dtype='bfloat16', cache_max_entry_count=0.3,
                                                   max_batch_size=64, session_len=20000, eager_mode=eager))
    print(f'[{name}] engine built in {time.perf_counter() - t:.1f}s', file=out, flush=True)
    step_times(engine, [prompt(64, 1)], 8)  # warm-up
    step_times(engine, [prompt(512, 2 + i) for i in range(64)], 4)
    for batch in (1, 64):
        pre, dec = step_times(engine, [prompt(512, 100 + batch + i) for i in range(batch)], 64)
        print(f'[{name}] batch {batch}: prefill steps {len(pre)} median {med(pre)} ms; decode steps {len(dec)} '
              f'median {med(dec)} ms', file=out, flush=True)
    pre, _ = step_times(engine, [prompt(1024, 7)], 1)
    print(f'[{name}] 1K prefill step: {med(pre)} ms', file=out, flush=True)

    from lmdeploy.pytorch.messages import SamplingParams
    for batch in (1, 64):
        for i in range(batch):
            engine.add_request(prompt(512, 300 + i), SamplingParams(max_new_tokens=40, min_new_tokens=40,
                                                                    stop_token_ids=()))
        for _ in range(6):
            engine.step()  # prefill
        prof = cProfile.Profile()
        torch.cuda.synchronize()
        t = time.perf_counter()
        prof.enable()
        for _ in range(20):
            engine.step()
        torch.cuda.synchronize()
        prof.disable()
        wall = (time.perf_counter() - t) / 20 * 1e3
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats('tottime').print_stats(25)
        print(f'[{name}] cProfile of 20 decode steps at batch {batch} ({wall:.2f} ms/step incl. profiler):',
              file=out)
        print(s.getvalue(), file=out, flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as tp:
            for _ in range(5):
                engine.step()
            torch.cuda.synchronize()
        print(f'[{name}] torch.profiler, 5 decode steps at batch {batch}:', file=out)
        print(tp.key_averages().table(sort_by='cuda_time_total', row_limit=25), file=out, flush=True)
        engine.run_until_idle()
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--model-dir', default='/tmp/qwen3next_bench')
    p.add_argument('--modes', nargs='+', default=['eager', 'graph'], choices=['eager', 'graph'])
    p.add_argument('--out', default=None, help='folder for profile.txt (default: stdout only)')
    args = p.parse_args()
    build_if_missing(args.model_dir)
    out = sys.stdout
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        out = open(os.path.join(args.out, 'profile.txt'), 'w')
    for mode in args.modes:
        profile_mode(args.model_dir, mode == 'eager', out)
    if out is not sys.stdout:
        out.close()
        print(open(os.path.join(args.out, 'profile.txt')).read()[:20000])


if __name__ == '__main__':
    main()
