"""Engine host work per cold prompt, prefix caching off vs on, with the model forward stubbed out.

The cold-TTFT target (cache on within 5% of off) is about the host work the prefix cache adds around a prefill:
admission matching, checkpoint planning, cache-copy plans, attaching blocks, publishing checkpoints. This bench
isolates it: the model's forward returns zeros of the right shape at once, so the measured time from
`add_request` to the first token's callback is the engine's own work (scheduling, input building, bookkeeping on
the path to the first token), on whatever CPU runs it. Every prompt is new (random ids), as in a cold-TTFT run.

    python benchmark/bench_host_overhead.py [--tokens 1024 4096 16384] [--reps 20] [--profile]

With --prefix P, each timed prompt is one cached P-token prefix (computed by the warm-up requests) plus --tokens
new ones: the host work of the suffix-after-a-cached-prefix row (prefix matching, checkpoint restores, the
partial block's copy plan), which prefix caching off does not have, so only the cache-on run is timed.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
import time

import torch

from lmdeploy.demo_model import save_tiny_model
from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.messages import SamplingParams


def host_ttfts(path: str, tokens: int, reps: int, prefix_caching: bool, args, profile=None) -> list[float]:
    engine = Engine(path, PytorchEngineConfig(
        device_type='cpu', dtype='float32', block_size=args.block_size, num_gpu_blocks=args.num_blocks,
        max_prefill_token_num=args.max_prefill_token_num, session_len=args.prefix + tokens + 64, max_batch_size=64,
        enable_prefix_caching=prefix_caching))
    hidden = engine.model_config.hidden_size
    engine.agent.model.forward = lambda ctx: torch.zeros(ctx.inputs.input_ids.numel(), hidden)
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(tokens)
    prefix = torch.randint(0, vocab, (args.prefix,), generator=g).tolist()
    if prefix:  # the prefix alone, so the engine checkpoints its exact end
        engine.add_request(prefix, SamplingParams(max_new_tokens=1))
        while engine.has_work:
            engine.step()
    out = []
    for rep in range(reps + 2):  # two warm-up requests
        prompt = prefix + torch.randint(0, vocab, (tokens,), generator=g).tolist()
        first: list[float] = []
        first_cached: list[int] = []

        def on_output(out, first=first, first_cached=first_cached):
            if out.new_token_ids and not first:
                first.append(time.perf_counter())
                first_cached.append(out.num_cached)
        if profile is not None and rep == 2:
            profile.enable()
        start = time.perf_counter()
        engine.add_request(prompt, SamplingParams(max_new_tokens=1), callback=on_output)
        while engine.has_work:
            engine.step()
        if rep >= 2:
            out.append((first[0] - start) * 1e3)
            if prefix:
                assert first_cached[0] == len(prefix), f'{first_cached} cached, not the {len(prefix)}-token prefix'
    if profile is not None:
        profile.disable()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--tokens', type=int, nargs='+', default=[1024, 4096, 16384])
    parser.add_argument('--reps', type=int, default=20)
    parser.add_argument('--arch', default='qwen3_next')
    parser.add_argument('--block-size', type=int, default=64)
    parser.add_argument('--max-prefill-token-num', type=int, default=8192)
    parser.add_argument('--num-blocks', type=int, default=20000)
    parser.add_argument('--prefix', type=int, default=0, help='a cached prefix before each prompt (cache on only)')
    parser.add_argument('--top', type=int, default=30, help='functions --profile prints')
    parser.add_argument('--sort', default='cumulative', help='pstats sort key of --profile (tottime: own time)')
    parser.add_argument('--profile', action='store_true', help='print the cache-on run\'s top functions')
    args = parser.parse_args()
    path = save_tiny_model(tempfile.mkdtemp(), arch=args.arch,
                           config_overrides={'max_position_embeddings': args.prefix + max(args.tokens) + 64})
    if args.prefix:
        print(f'| new tokens after a cached {args.prefix}-token prefix | host ms (median / min) |\n|---:|---:|')
    else:
        print('| prompt tokens | host ms, cache off (median / min) | host ms, cache on (median / min) '
              '| on - off (median) |\n|---:|---:|---:|---:|')
    for n in args.tokens:
        profile = cProfile.Profile() if args.profile else None
        on = host_ttfts(path, n, args.reps, True, args, profile)
        if args.prefix:
            print(f'| {n} | {statistics.median(on):.2f} / {min(on):.2f} |', flush=True)
        else:
            off = host_ttfts(path, n, args.reps, False, args)
            print(f'| {n} | {statistics.median(off):.2f} / {min(off):.2f} | {statistics.median(on):.2f} / '
                  f'{min(on):.2f} | {statistics.median(on) - statistics.median(off):+.2f} |', flush=True)
        if profile is not None:
            pstats.Stats(profile).sort_stats(args.sort).print_stats(args.top)


if __name__ == '__main__':
    main()
