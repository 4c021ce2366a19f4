"""Decode cost of LoRA adapters: engine decode steps at batch 1 and 64, without adapters and with several mixed.

A random-weight Qwen3.5-shaped model (0.8B dimensions, `--layers` layers, bf16) is served by two engines on the
GPU: one without adapters, one with `--adapters` PEFT folders (random rank-`--rank` LoRA on every attention,
gated-delta and MLP projection). Each engine decodes `batch` requests together (prompt `--prompt-len` tokens,
`--new-tokens` generated, no stop ids) in these row mixes:

- `no-lora`: the engine without adapters (the baseline);
- `base-rows`: the LoRA engine, every row on the base model (what adapters cost requests that do not use them);
- `one-adapter`: every row on adapter 0;
- `mixed`: rows round-robin over every adapter and the base model.

A decode step is timed on the host around `Engine.step()` (it returns after the sampled ids reach the host, so
the time is the whole step); the median over steps whose batch is all decodes of every row is reported, with CUDA
graphs on (the default) or off (`--eager`). Then the LoRA op alone (`OpType.LoRA`, cuda backend) against the base
projection it rides on, device time in a CUDA graph.

    python benchmark/bench_lora_decode.py [--layers 8] [--adapters 4] [--rank 16] [--eager]

Prints tables and, last, one JSON line.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lmdeploy.demo_model import save_tiny_model
from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.messages import SamplingParams

TARGETS = ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'in_proj_qkv', 'in_proj_z', 'in_proj_b', 'in_proj_a', 'out_proj',
           'gate_proj', 'up_proj', 'down_proj')


def model_overrides(layers: int) -> dict:
    """Qwen3.5-0.8B dimensions (docs: hidden 1024, attention 8/2 x 256, gated delta 16/16 x 128)."""
    types = ['full_attention' if (i + 1) % 4 == 0 else 'linear_attention' for i in range(layers)]
    return dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=layers, layer_types=types,
                num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                initializer_range=0.02, max_position_embeddings=8192)


def save_random_lora(path: str, model_path: str, rank: int, seed: int) -> str:
    """A PEFT LoRA folder adapting every TARGETS module of the checkpoint (random A and B)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    with safe_open(os.path.join(model_path, 'model.safetensors'), framework='pt') as handle:
        for key in handle.keys():
            module, _, leaf = key.rpartition('.')
            if leaf == 'weight' and module.rsplit('.', 1)[-1] in TARGETS:
                out_features, in_features = handle.get_slice(key).get_shape()
                prefix = f'base_model.model.{module}'
                tensors[f'{prefix}.lora_A.weight'] = torch.randn(rank, in_features, generator=gen) / in_features**.5
                tensors[f'{prefix}.lora_B.weight'] = torch.randn(out_features, rank, generator=gen) * 0.01
    os.makedirs(path, exist_ok=True)
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, os.path.join(path, 'adapter_model.safetensors'))
    with open(os.path.join(path, 'adapter_config.json'), 'w') as f:
        json.dump({'peft_type': 'LORA', 'r': rank, 'lora_alpha': 2 * rank, 'target_modules': list(TARGETS)}, f)
    return path


def decode_step_ms(engine: Engine, batch: int, adapters: list[str | None], args: argparse.Namespace) -> float:
    """Median wall time of the steps that decode all `batch` rows."""
    decode_rows: list[int] = []
    make = engine.inputs_maker.make

    def recording_make(sched):
        inputs, sampled = make(sched)
        decode_rows.append(inputs.batch_size if inputs.is_decode else 0)
        return inputs, sampled
    engine.inputs_maker.make = recording_make
    gen = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(0, 1000, (args.prompt_len,), generator=gen).tolist()
        engine.add_request(prompt, SamplingParams(max_new_tokens=args.new_tokens),  # no stop ids: never stops early
                           adapter_name=adapters[i % len(adapters)])
    times = []
    while engine.has_work:
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if decode_rows and decode_rows[-1] == batch:
            times.append(elapsed * 1e3)
        decode_rows.clear()
    engine.inputs_maker.make = make
    return statistics.median(times[2:] or times)


def engine_rows(args: argparse.Namespace, model_path: str, adapter_paths: dict[str, str]) -> list[dict]:
    config = dict(device_type=args.device, dtype='bfloat16' if args.device == 'cuda' else 'float32',
                  max_batch_size=64, eager_mode=args.eager,
                  cache_max_entry_count=0.3, session_len=args.prompt_len + args.new_tokens + 64)
    rows = []
    names = list(adapter_paths)
    plain = Engine(model_path, PytorchEngineConfig(**config))
    for batch in (1, 64):
        rows.append(dict(batch=batch, mix='no-lora', ms=decode_step_ms(plain, batch, [None], args)))
    del plain
    if args.device == 'cuda':
        torch.cuda.empty_cache()
    lora = Engine(model_path, PytorchEngineConfig(adapters=adapter_paths, max_lora_rank=max(args.rank, 16), **config))
    mixes = {'base-rows': [None], 'one-adapter': names[:1], 'mixed': [*names, None]}
    for batch in (1, 64):
        for mix, adapters in mixes.items():
            rows.append(dict(batch=batch, mix=mix, ms=decode_step_ms(lora, batch, adapters, args)))
    for row in rows:
        base = next(r['ms'] for r in rows if r['batch'] == row['batch'] and r['mix'] == 'no-lora')
        row['vs_no_lora'] = row['ms'] / base
        row['tok_s'] = row['batch'] * 1e3 / row['ms']
    return rows


def graph_ms(fn, iters: int = 50, per_graph: int = 20) -> float:
    for _ in range(3):
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (iters * per_graph)


def op_rows(args: argparse.Namespace) -> list[dict]:
    """The LoRA op against its base projection, for the 0.8B model's widest fused layers."""
    from lmdeploy.pytorch.kernels.cuda.lora import sgmv_lora
    shapes = {'in_proj_qkvz': (1024, [6144, 2048]), 'gate_up_proj': (1024, [3584, 3584]),
              'down_proj': (3584, [1024])}
    rows = []
    slots = args.adapters + 1
    for name, (fan_in, sizes) in shapes.items():
        weight = torch.randn(sum(sizes), fan_in, device='cuda', dtype=torch.bfloat16) * 0.02
        lora_a = torch.randn(slots, len(sizes) * args.rank, fan_in, device='cuda', dtype=torch.bfloat16) * 0.02
        lora_b = torch.randn(slots, sum(sizes), args.rank, device='cuda', dtype=torch.bfloat16) * 0.02
        for batch in (1, 64):
            x = torch.randn(batch, fan_in, device='cuda', dtype=torch.bfloat16)
            out = torch.empty(batch, sum(sizes), device='cuda', dtype=torch.bfloat16)
            seq_slots = torch.arange(batch, device='cuda') % slots
            cu = torch.arange(batch + 1, device='cuda')
            base = graph_ms(functools.partial(torch.matmul, x, weight.t(), out=out))
            lora = graph_ms(functools.partial(sgmv_lora, x, out, lora_a, lora_b, sizes, seq_slots, cu, 1))
            rows.append(dict(layer=name, batch=batch, base_us=base * 1e3, lora_us=lora * 1e3, ratio=lora / base))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--layers', type=int, default=8)
    parser.add_argument('--adapters', type=int, default=4)
    parser.add_argument('--rank', type=int, default=16)
    parser.add_argument('--prompt-len', type=int, default=64)
    parser.add_argument('--new-tokens', type=int, default=48)
    parser.add_argument('--eager', action='store_true', help='decode without CUDA graphs')
    parser.add_argument('--device', default='cuda', choices=['cuda', 'cpu'], help='cpu: a smoke run of the engine '
                        'part only (no op table)')
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_path = save_tiny_model(os.path.join(tmp, 'model'), arch='qwen3_5',
                                     config_overrides=model_overrides(args.layers), dtype='bfloat16')
        adapters = {f'lora{i}': save_random_lora(os.path.join(tmp, f'lora{i}'), model_path, args.rank, seed=i)
                    for i in range(args.adapters)}
        engine = engine_rows(args, model_path, adapters)
    ops = op_rows(args) if args.device == 'cuda' else []
    print(f'decode step, {args.layers} layers, {args.adapters} adapters of rank {args.rank}, '
          f'graphs {"off" if args.eager or args.device != "cuda" else "on"}')
    print(f'{"batch":>5} {"mix":>12} {"ms/step":>9} {"tok/s":>9} {"vs no-lora":>10}')
    for r in engine:
        print(f'{r["batch"]:>5} {r["mix"]:>12} {r["ms"]:>9.3f} {r["tok_s"]:>9.0f} {r["vs_no_lora"]:>10.2f}')
    print(f'\nLoRA op (SGMV shrink + expand) vs its base projection, device time, rank {args.rank}')
    print(f'{"layer":>14} {"batch":>5} {"base us":>9} {"lora us":>9} {"ratio":>6}')
    for r in ops:
        print(f'{r["layer"]:>14} {r["batch"]:>5} {r["base_us"]:>9.1f} {r["lora_us"]:>9.1f} {r["ratio"]:>6.2f}')
    print(json.dumps({'engine': engine, 'op': ops, 'args': vars(args)}))


if __name__ == '__main__':
    main()
