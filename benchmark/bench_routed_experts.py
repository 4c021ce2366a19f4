"""Decode throughput with routed experts off and on: does a request that did not ask pay anything?

Modes (same engine geometry, same prompts, greedy, eos ignored):

- `off`: `enable_return_routed_experts=False`;
- `on, not asked`: the engine flag on, no request asks (what every other request of a routed engine pays);
- `on, asked`: the flag on and every request asks (the recording cost itself: one `[T, top_k]` copy per MoE layer
  and one `[T, num_moe_layers, top_k]` device-to-host copy per forward).
- `on + cache, asked` (with `--prefix-caching`): also prefix caching, which makes every request record so that
  cached blocks and checkpoints keep routes.

Each run submits `--batch` requests of `--prompt` random tokens, steps the engine until every request has its first
token (prefill), then times the decode steps until all have `--decode` tokens: decode tokens/s = tokens produced
in that window / its wall time. Modes run interleaved `--reps` times; the best and the median round are reported
(on a shared machine other load only slows a round down, so the best is the steadier comparison).

    python benchmark/bench_routed_experts.py                       # tiny Qwen3-Next on the CPU
    python benchmark/bench_routed_experts.py --device cuda --shape a3b --batch 32 --decode 128
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from lmdeploy.demo_model import save_tiny_model
from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.messages import SamplingParams

# Qwen3.5-35B-A3B's layer shapes (hidden 2048, top-8 of experts of width 512, attention 16/2 x 256, gated delta
# 16/32 x 128) with 4 layers and 64 experts instead of 256 (the random checkpoint is built and saved on the fly:
# ~0.9B parameters keep that under a minute), random weights.
SHAPES = {
    'tiny': {},
    'a3b': dict(num_hidden_layers=4, hidden_size=2048, intermediate_size=512, num_attention_heads=16,
                num_key_value_heads=2, head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128,
                linear_num_key_heads=16, linear_num_value_heads=32, num_experts=64, num_experts_per_tok=8,
                moe_intermediate_size=512, shared_expert_intermediate_size=512,
                layer_types=['linear_attention'] * 3 + ['full_attention'], max_position_embeddings=8192),
}
MODES = {'off': (False, False, False), 'on, not asked': (True, False, False), 'on, asked': (True, True, False),
         'on + cache, asked': (True, True, True)}


def decode_rate(engine: Engine, prompts: list[list[int]], decode: int, ask: bool) -> float:
    produced = [0] * len(prompts)

    def counter(i):
        def on_output(out):
            produced[i] += len(out.new_token_ids)
        return on_output
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(max_new_tokens=decode + 1, return_routed_experts=ask),
                           callback=counter(i))
    while min(produced) == 0:
        engine.step()
    if engine.device.type == 'cuda':
        torch.cuda.synchronize()
    start, before = time.perf_counter(), sum(produced)
    while engine.has_work:
        engine.step()
    if engine.device.type == 'cuda':
        torch.cuda.synchronize()
    return (sum(produced) - before) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--model', default=None, help='a MoE checkpoint folder (default: a random one of --shape)')
    parser.add_argument('--shape', default='tiny', choices=sorted(SHAPES))
    parser.add_argument('--device', default='cpu', choices=['cpu', 'cuda'])
    parser.add_argument('--batch', type=int, default=8)
    parser.add_argument('--prompt', type=int, default=64)
    parser.add_argument('--decode', type=int, default=64)
    parser.add_argument('--reps', type=int, default=5)
    parser.add_argument('--prefix-caching', action='store_true', help='also run the "on + cache" mode')
    parser.add_argument('--eager-mode', action='store_true')
    args = parser.parse_args()
    started = time.perf_counter()
    path = args.model or save_tiny_model(tempfile.mkdtemp(), arch='qwen3_next', config_overrides=SHAPES[args.shape])
    print(f'checkpoint ready after {time.perf_counter() - started:.0f} s', flush=True)
    modes = [m for m in MODES if args.prefix_caching or not MODES[m][2]]
    engines = {}
    for mode in modes:
        flag, _, cache = MODES[mode]
        engines[mode] = Engine(path, PytorchEngineConfig(
            device_type=args.device, max_batch_size=args.batch, eager_mode=args.eager_mode,
            enable_prefix_caching=cache, enable_return_routed_experts=flag,
            session_len=args.prompt + args.decode + 8, cache_max_entry_count=0.3))
    config = next(iter(engines.values())).model_config
    print(f'model: {path} ({config.num_layers} layers, {config.num_moe_layers} MoE, top-{config.moe_top_k}), '
          f'device {args.device}, batch {args.batch}, prompt {args.prompt}, decode {args.decode}; engines ready '
          f'after {time.perf_counter() - started:.0f} s', flush=True)
    g = torch.Generator().manual_seed(0)
    rates = {mode: [] for mode in modes}
    for rep in range(args.reps + 1):  # the first round warms up (kernels, graphs, allocator)
        prompts = [torch.randint(0, config.vocab_size, (args.prompt,), generator=g).tolist()
                   for _ in range(args.batch)]  # new prompts per round: no cache hits across rounds
        for mode in modes:
            rate = decode_rate(engines[mode], prompts, args.decode, MODES[mode][1])
            if rep:
                rates[mode].append(rate)
        if rep:  # progress, so that a run cut short still shows its rounds
            print(f'round {rep}: ' + ', '.join(f'{m} {rates[m][-1]:.1f}' for m in modes)
                  + f' tokens/s ({time.perf_counter() - started:.0f} s)', flush=True)
    best_off, median_off = max(rates['off']), statistics.median(rates['off'])
    print('| mode | decode tokens/s, best | median | best vs off | median vs off |')
    print('|---|---:|---:|---:|---:|')
    for mode in modes:
        best, med = max(rates[mode]), statistics.median(rates[mode])
        print(f'| {mode} | {best:.1f} | {med:.1f} | {best / best_off - 1:+.1%} | {med / median_off - 1:+.1%} |')


if __name__ == '__main__':
    main()
