"""Cold TTFT with prefill CUDA graphs against eager prefills, on a real-width hybrid with dummy weights.

A Qwen3.5-9B-shaped model (`Qwen3_5TextConfig()`'s widths, dense MLP; `--shape qwen3-next`: the MoE widths of
`bench_vs_transformers.py`), `--layers` deep, 3 gated DeltaNet : 1 attention, is written as a config-only folder and
loaded with `load_format='dummy'` (random bf16 weights drawn on
the device). Two engines in turn, same prompts: graphs (the default: decode graphs and, for every token bucket up
to 4096, a prefill graph captured at start-up) and `eager_mode=True`. Prefix caching is off, so every prompt is
a cold prefill of one forward. Per engine it reports:
  - start-up (the `Engine` constructor, graph capture included) and the start-up capture alone
    (`graph_runner.capture_seconds`, `capture_bytes`);
  - the first request of each length after start-up, then the median of `--reps` later requests of that length
    (new random prompts each), wall-clock from `add_request` to the first token's callback.
Host-bound prefills show as graphs << eager; the first-request column shows whether any request still pays for
compilation or autotuning (target: within 1.2x of later requests).

    python benchmark/bench_prefill_graphs.py [--layers 16] [--shape qwen3.5-9b] [--sizes 1024 2048 4096] [--reps 3]
    python benchmark/bench_prefill_graphs.py --smoke     # tiny float32 model on the CPU, eager: the logic only

Prints one line per measurement, a markdown table and, last, one JSON line.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import sys
import tempfile
import time

print('bench_prefill_graphs: importing torch ...', flush=True)  # progress before the slow imports
import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def write_config(path: str, layers: int, shape: str, smoke: bool = False) -> None:
    """A config-only folder: Qwen3.5-9B-shaped (`Qwen3_5TextConfig()`'s widths, dense MLP) or Qwen3-Next-shaped
    (the widths of `bench_vs_transformers.py`, MoE), `layers` deep, 3 gated DeltaNet : 1 attention."""
    import transformers as tf
    from bench_vs_transformers import FULL, FULL_CONFIG, LINEAR, SMOKE_CONFIG
    layer_types = [FULL if (i + 1) % 4 == 0 else LINEAR for i in range(layers)]
    if shape == 'qwen3.5-9b':
        widths = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                      linear_value_head_dim=16, vocab_size=1024) if smoke else {}
        config = tf.Qwen3_5TextConfig(num_hidden_layers=layers, layer_types=layer_types, **widths)
        config.architectures = ['Qwen3_5ForCausalLM']
    else:
        cfg = dict(SMOKE_CONFIG if smoke else FULL_CONFIG, num_hidden_layers=layers, layer_types=layer_types)
        config = tf.Qwen3NextConfig(**cfg, architectures=['Qwen3NextForCausalLM'])
    config.save_pretrained(path)
    tf.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=1).save_pretrained(path)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def ttft_ms(engine, prompt: list[int]) -> float:
    from lmdeploy.pytorch.messages import SamplingParams
    first = []
    sync()
    t0 = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_new_tokens=1, temperature=0.0),
                       callback=lambda out: first or (out.new_token_ids and first.append(time.perf_counter())))
    while engine.has_work:
        engine.step()
    return (first[0] - t0) * 1e3


def run_engine(args, path: str, eager: bool) -> dict:
    from lmdeploy.messages import PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine
    device = 'cpu' if args.smoke else 'cuda'
    config = PytorchEngineConfig(device_type=device, dtype='float32' if args.smoke else 'bfloat16',
                                 load_format='dummy', eager_mode=eager,
                                 cache_max_entry_count=args.cache_max_entry_count, max_batch_size=args.max_batch_size,
                                 max_prefill_token_num=max(args.sizes), session_len=max(args.sizes) + 64,
                                 enable_prefix_caching=False)
    name = 'eager' if eager else 'graphs'
    print(f'{name}: building the engine ...', flush=True)
    t = time.perf_counter()
    engine = Engine(path, config)
    sync()
    res = {'startup_s': time.perf_counter() - t, 'engine_startup_s': engine.startup_seconds}
    runner = getattr(engine.agent, 'graph_runner', None)
    if runner is not None:
        res.update(capture_s=runner.capture_seconds, capture_mib=runner.capture_bytes / 2**20,
                   graphs=len(runner.graphs))
    print(f'{name}: start-up {res["startup_s"]:.1f} s ' + (f'(capture {res["capture_s"]:.2f} s, '
          f'{res["capture_mib"]:.0f} MiB, {res["graphs"]} graphs)' if runner is not None else ''), flush=True)
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    for size in args.sizes:
        prompts = [torch.randint(0, vocab, (size,), generator=gen).tolist() for _ in range(args.reps + 1)]
        times = [ttft_ms(engine, p) for p in prompts]
        res[size] = {'first_ms': times[0], 'ms': statistics.median(times[1:]), 'all_ms': times}
        print(f'{name}: {size} tokens first {times[0]:.1f} ms, later median {res[size]["ms"]:.1f} ms '
              f'({", ".join(f"{x:.1f}" for x in times[1:])})', flush=True)
    if runner is not None:
        res['prefill_replays'] = runner.num_prefill_replays
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--layers', type=int, default=16)
    p.add_argument('--shape', choices=['qwen3.5-9b', 'qwen3-next'], default='qwen3.5-9b')
    p.add_argument('--sizes', type=int, nargs='+', default=[1024, 2048, 4096])
    p.add_argument('--reps', type=int, default=3)
    p.add_argument('--max-batch-size', type=int, default=16)
    p.add_argument('--cache-max-entry-count', type=float, default=0.3)
    p.add_argument('--modes', nargs='+', default=['graphs', 'eager'], choices=['graphs', 'eager'])
    p.add_argument('--smoke', action='store_true', help='tiny float32 model, eager, on the CPU: checks the logic')
    args = p.parse_args()
    # the engine's start-up log lines (eager warm-up, each captured graph, start-up time) are the progress report
    logging.basicConfig(level=logging.INFO, format='%(asctime)s %(message)s', stream=sys.stdout, force=True)
    logging.getLogger('lmdeploy').setLevel(logging.INFO)
    print(f'bench_prefill_graphs: LMDEPLOY_PREFILL_GRAPH_TOKENS={os.environ.get("LMDEPLOY_PREFILL_GRAPH_TOKENS")} '
          f'LMDEPLOY_GRAPH_GDR={os.environ.get("LMDEPLOY_GRAPH_GDR")} commit={os.environ.get("LMDEPLOY_COMMIT")}',
          flush=True)
    if args.smoke:
        args.modes, args.layers, args.sizes, args.reps = ['eager'], 4, [64, 128], 1
    results = {}
    with tempfile.TemporaryDirectory() as path:
        write_config(path, args.layers, args.shape, smoke=args.smoke)
        for mode in args.modes:
            results[mode] = run_engine(args, path, eager=mode == 'eager')
    print(f'\n{args.shape}-shaped, {args.layers} layers, dummy bf16 weights, prefix caching off; '
          f'{torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"}')
    print('| prompt tokens | ' + ' | '.join(f'{m} first / later (ms)' for m in args.modes) + ' | eager / graphs |')
    print('|---:|' + '---:|' * (len(args.modes) + 1))
    for size in args.sizes:
        cells = [f'{results[m][size]["first_ms"]:.1f} / {results[m][size]["ms"]:.1f}' for m in args.modes]
        ratio = results['eager'][size]['ms'] / results['graphs'][size]['ms'] if len(results) == 2 else float('nan')
        print(f'| {size} | ' + ' | '.join(cells) + f' | {ratio:.2f}x |')
    per_mode = {m: {str(k): v for k, v in r.items()} for m, r in results.items()}
    print(json.dumps({'shape': args.shape, 'layers': args.layers, **per_mode}))


if __name__ == '__main__':
    main()
