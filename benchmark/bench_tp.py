"""Tensor parallelism on one host: the engine at TP=1 against TP=N on a real-depth shape with random (dummy) bf16
weights: decode tokens/s at batch 1 and 64, cold TTFT at 8K and 32K, suffix TTFT after a cached prefix, and the
all-reduce time per step.

Each TP value runs in its own child process (one engine at a time; a TP engine's rank 0 owns the process's
torch.distributed group), through the engine's public calls (`Engine.add_request` / `step`), with CUDA graphs on.
The all-reduce time per step is measured apart: `tp` processes (NCCL, NVLink multicast off, as the engine runs it)
time `dist.all_reduce` of a `[tokens, hidden]` bf16 tensor, and a step runs 2 of them per decoder layer
(`nn/parallel.py`), so per step = 2 x layers x that median. At TP=1 it is 0 by construction, and the child checks
it: no process group exists and every reduction point of the model has no group (an identity).
`--fit-80b` instead builds a Qwen3-Next-80B-shaped model with all 512 experts (too large for one H200 in bf16) at
TP=N only, and runs one short request.

The default shape is transformers' `Qwen3_5TextConfig()` (Qwen3.5-9B: 32 layers, hidden 4096), the shape of
`bench_real_depth.py`'s baseline in docs/benchmarks.md, so a TP=1 row compares with it. `--budget-s` bounds each
child: rows not started by then are reported as skipped, so the run always ends with its table.

    python benchmark/bench_tp.py --tp 1                 # one GPU: < 2 minutes on an H200
    python benchmark/bench_tp.py [--tp 1 2] [--shape qwen3.5-27b] [--layers 64] [--batches 1 64] \
        [--cold 8192 32768] [--suffix-prefix 8100]
    python benchmark/bench_tp.py --fit-80b --tp 2
    python benchmark/bench_tp.py --smoke      # tiny shape on the CPU, gloo (a check that the script runs)

Progress goes to stderr; the table, then one JSON line, to stdout. The commit printed is $LMDEPLOY_COMMIT where the
runner sets it (a copied checkout's git metadata may be stale), else git's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from real_depth_report import _commit  # noqa: E402

SHAPES = {
    # transformers' Qwen3_5TextConfig() defaults (Qwen3.5-9B: 32 layers, hidden 4096, 16/4 x 256 attention,
    # 16/32 x 128 gated delta, vocab 248320): the real-depth baseline shape
    'qwen3.5-9b': dict(arch='Qwen3_5ForCausalLM'),
    # Qwen3.5-27B's dimensions (docs: wave-2 facts)
    'qwen3.5-27b': dict(arch='Qwen3_5ForCausalLM', hidden_size=5120, intermediate_size=17408, num_attention_heads=24,
                        num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
                        linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320, layers=64),
    # Qwen3-Next-80B-A3B: 512 experts, top-10 (bf16 weights ~160 GB: more than one H200)
    'qwen3-next-80b': dict(arch='Qwen3NextForCausalLM', hidden_size=2048, intermediate_size=5120,
                           num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                           linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                           vocab_size=151936, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                           shared_expert_intermediate_size=512, layers=48),
    'smoke': dict(arch='Qwen3_5ForCausalLM', hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=6,
                  linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=512, layers=4),
}


def progress(tp: int, began: float, what: str) -> None:
    print(f'[bench_tp tp={tp} +{time.perf_counter() - began:.1f}s] {what}', file=sys.stderr, flush=True)


def write_config(path: str, shape: dict, layers: int | None):
    """The shape's config (the class defaults for what it does not name), `layers` deep (None: the shape's)."""
    import transformers
    shape = dict(shape)
    arch, layers = shape.pop('arch'), layers or shape.pop('layers', None)
    shape.pop('layers', None)
    if layers is not None:
        shape.update(num_hidden_layers=layers,
                     layer_types=['full_attention' if (i + 1) % 4 == 0 else 'linear_attention' for i in range(layers)])
    cls = transformers.Qwen3NextConfig if arch == 'Qwen3NextForCausalLM' else transformers.Qwen3_5TextConfig
    config = cls(max_position_embeddings=65536, **shape)
    config.architectures = [arch]
    config.save_pretrained(path)
    return config


def run(engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[dict]]:
    from lmdeploy.pytorch.messages import SamplingParams
    params = SamplingParams(max_new_tokens=new_tokens, min_new_tokens=new_tokens, stop_token_ids=())
    recs = [dict(first=None, end=None, times=[], cached=0, error=None) for _ in prompts]

    def on_output(rec):
        def callback(out):
            now = time.perf_counter()
            if out.new_token_ids and rec['first'] is None:
                rec['first'] = now
            rec['times'] += [now] * len(out.new_token_ids)
            rec['cached'] = max(rec['cached'], out.num_cached)
            rec['error'] = rec['error'] or out.error
            if out.finished:
                rec['end'] = now
        return callback

    t0 = time.perf_counter()
    for prompt, rec in zip(prompts, recs):
        engine.add_request(prompt, params, on_output(rec))
    while engine.has_work:
        engine.step()
    errors = [r['error'] for r in recs if r['error']]
    if errors:
        raise RuntimeError(f'{len(errors)} request(s) failed: {errors[0]}')
    return t0, recs


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def collectives(engine, tp: int) -> dict:
    """What the engine's model reduces over: at TP=1 no process group may exist and every reduction point must be
    an identity (no group), so its all-reduce time per step is 0; anything else is an error here."""
    import torch.distributed as dist

    from lmdeploy.pytorch.nn.parallel import reduction_points
    points = reduction_points(engine.model)
    grouped = sum(point.group is not None for point in points)
    if tp == 1 and (dist.is_initialized() or grouped or engine.tp_workers is not None):
        raise RuntimeError(f'TP=1 ran collectives: process group {dist.is_initialized()}, {grouped} of '
                           f'{len(points)} reduction points grouped, workers {engine.tp_workers}')
    if tp > 1 and grouped != len(points):
        raise RuntimeError(f'TP={tp}: only {grouped} of {len(points)} reduction points reduce over the group')
    return {'process_group': dist.is_initialized(), 'reduction_points': len(points)}


def measure_engine(args, tp: int) -> dict:
    """The rows, in order, each only if the budget has room left (else listed under 'skipped')."""
    from lmdeploy.messages import PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine
    began = time.perf_counter()
    deadline = began + args.budget_s
    device = 'cpu' if args.smoke else 'cuda'
    engine = Engine(args.model_dir, PytorchEngineConfig(
        device_type=device, tp=tp, load_format='dummy', dtype='float32' if args.smoke else 'bfloat16',
        max_batch_size=max(args.batches), enable_prefix_caching=True, session_len=max(args.cold) + 1024,
        max_prefill_token_num=args.max_prefill, cache_max_entry_count=args.cache_max_entry_count))
    out = {'tp': tp, 'start_s': round(time.perf_counter() - began, 1), 'kv_blocks': engine.cache_config.num_blocks,
           'async_scheduling': engine.async_scheduling, **collectives(engine, tp), 'skipped': []}
    progress(tp, began, f'engine started: {out}')
    vocab = engine.model_config.vocab_size
    rows = [(f'decode_tok_s_b{batch}', lambda batch=batch: decode_rate(args, engine, batch, vocab))
            for batch in args.batches]
    rows += [(f'cold_ttft_ms_{size}', lambda size=size: cold_ttft(args, engine, size, vocab)) for size in args.cold]
    rows.append((f'suffix_ttft_ms_{args.suffix_prefix}+{args.suffix_len}', lambda: suffix_ttft(args, engine, vocab)))
    try:
        run(engine, [prompt(64, 1, vocab)], 4)  # warm-up
        for name, measure in rows:
            if time.perf_counter() > deadline:
                out['skipped'].append(name)
                progress(tp, began, f'{name}: skipped (past --budget-s {args.budget_s:.0f})')
                continue
            value = measure()
            out.update(value if isinstance(value, dict) else {name: value})
            progress(tp, began, f'{name}: {value}')
    finally:
        engine.close()
    return out


def decode_rate(args, engine, batch: int, vocab: int) -> float:
    """Tokens/s of `batch` requests once every one has its first token (median over reps)."""
    prompts = [prompt(args.decode_prompt, 100 * batch + i, vocab) for i in range(batch)]
    run(engine, prompts, 4)  # warm-up at this batch size (graphs)
    rates = []
    for rep in range(args.reps):
        _, recs = run(engine, [p + [rep] for p in prompts], args.decode_tokens)
        last_first, end = max(r['first'] for r in recs), max(r['end'] for r in recs)
        after = sum(1 for r in recs for x in r['times'] if x > last_first)
        rates.append(after / (end - last_first))
    return round(statistics.median(rates), 1)


def cold_ttft(args, engine, size: int, vocab: int) -> float:
    ttfts = []
    for rep in range(args.reps):
        t0, (rec,) = run(engine, [prompt(size, 7000 + 10 * size + rep, vocab)], 1)
        ttfts.append((rec['first'] - t0) * 1e3)
    return round(statistics.median(ttfts), 1)


def suffix_ttft(args, engine, vocab: int) -> dict:
    """TTFT of a suffix after its prefix was served once (the hit: `suffix_cached_tokens`, the least over reps)."""
    ttfts, cached = [], []
    for rep in range(args.reps):
        prefix = prompt(args.suffix_prefix, 9000 + rep, vocab)
        run(engine, [prefix], 1)
        t0, (rec,) = run(engine, [prefix + prompt(args.suffix_len, 9500 + rep, vocab)], 1)
        ttfts.append((rec['first'] - t0) * 1e3)
        cached.append(rec['cached'])
    return {f'suffix_ttft_ms_{args.suffix_prefix}+{args.suffix_len}': round(statistics.median(ttfts), 1),
            'suffix_cached_tokens': min(cached)}


def _allreduce_worker(rank: int, tp: int, port: int, device_type: str, sizes: list[int], hidden: int, queue):
    import torch.distributed as dist

    from lmdeploy.pytorch.engine.tp_dist import DistInit, destroy_rank, init_rank
    init = DistInit(tp=tp, port=port, device_type=device_type)
    init_rank(init, rank)
    device = init.device_of(rank)
    dtype = torch.float32 if device_type == 'cpu' else torch.bfloat16
    result = {}
    for tokens in sizes:
        x = torch.ones(tokens, hidden, dtype=dtype, device=device)
        times = []
        for i in range(60):
            if device_type == 'cuda':
                torch.cuda.synchronize(device)
            t = time.perf_counter()
            dist.all_reduce(x)
            if device_type == 'cuda':
                torch.cuda.synchronize(device)
            if i >= 10:
                times.append((time.perf_counter() - t) * 1e6)
        result[tokens] = statistics.median(times)
    if rank == 0:
        queue.put(result)
    dist.barrier()
    destroy_rank()


def measure_allreduce(tp: int, device_type: str, sizes: list[int], hidden: int) -> dict:
    import torch.multiprocessing as mp

    from lmdeploy.pytorch.engine.tp_dist import disable_multicast, free_port
    disable_multicast()
    ctx = mp.get_context('spawn')
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_allreduce_worker, args=(r, tp, port, device_type, sizes, hidden, queue))
             for r in range(tp)]
    for p in procs:
        p.start()
    result = queue.get(timeout=300)
    for p in procs:
        p.join(60)
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--tp', type=int, nargs='+', default=[1, 2])
    parser.add_argument('--shape', choices=list(SHAPES), default='qwen3.5-9b')
    parser.add_argument('--layers', type=int, default=None, help='decoder layers (default: the shape\'s)')
    parser.add_argument('--batches', type=int, nargs='+', default=[1, 64])
    parser.add_argument('--decode-prompt', type=int, default=128)
    parser.add_argument('--decode-tokens', type=int, default=64)
    parser.add_argument('--cold', type=int, nargs='+', default=[8192, 32768])
    parser.add_argument('--suffix-prefix', type=int, default=8100, help='cached prefix (not block-aligned)')
    parser.add_argument('--suffix-len', type=int, default=100)
    parser.add_argument('--max-prefill', type=int, default=8192)
    parser.add_argument('--cache-max-entry-count', type=float, default=0.6)
    parser.add_argument('--reps', type=int, default=3)
    parser.add_argument('--budget-s', type=float, default=85.0,
                        help='per TP value: rows not started by then (from the engine start) are skipped')
    parser.add_argument('--fit-80b', action='store_true', help='only: the Qwen3-Next-80B shape with every expert '
                        'loads and serves one request at TP=max(--tp)')
    parser.add_argument('--smoke', action='store_true', help='tiny shape on the CPU (gloo)')
    parser.add_argument('--child', type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument('--model-dir', default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.shape, args.batches, args.cold, args.suffix_prefix, args.suffix_len = 'smoke', [1, 4], [64], 45, 8
        args.decode_prompt, args.decode_tokens, args.reps, args.max_prefill = 16, 8, 1, 64
    if args.fit_80b:
        args.shape = 'qwen3-next-80b'
    return args


def run_child(argv: list[str], tp: int, model_dir: str) -> dict:
    """One engine in a process of its own; its progress (stderr) passes through, its result comes on stdout."""
    cmd = [sys.executable, os.path.abspath(__file__), *argv, '--child', str(tp), '--model-dir', model_dir]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('RESULT ')]
    if proc.returncode or not lines:
        print(f'tp={tp}: failed (rc {proc.returncode}; its stderr is above)', flush=True)
        return {'tp': tp, 'error': f'rc {proc.returncode}'}
    return json.loads(lines[-1][len('RESULT '):])


def allreduce_rows(args, tps: list[int], rows: list[dict], hidden: int, layers: int) -> dict:
    """tp -> tokens -> all-reduce time per op and per step. TP=1: 0, from the child's check that it has no group."""
    table = {}
    for tp in tps:
        sizes = sorted({*args.batches, args.max_prefill})
        if tp == 1:
            ok = any(r.get('tp') == 1 and 'error' not in r and r.get('process_group') is False for r in rows)
            table[1] = {tokens: {'op_us': 0.0, 'per_step_ms': 0.0} for tokens in sizes} if ok else {}
        elif not args.fit_80b:
            per_op = measure_allreduce(tp, 'cpu' if args.smoke else 'cuda', sizes, hidden)
            table[tp] = {tokens: {'op_us': round(us, 1), 'per_step_ms': round(2 * layers * us / 1e3, 2)}
                         for tokens, us in per_op.items()}
    return table


def report(args, rows: list[dict], allreduce: dict, config) -> dict:
    from real_depth_floors import model_cost
    hidden, layers = config.hidden_size, config.num_hidden_layers
    experts = getattr(config, 'num_experts', 0) or 0
    weights_gib = model_cost(config).total_params * 2 / 2**30
    print(f'\nbench_tp: shape {args.shape}, {layers} layers, hidden {hidden}, {experts} experts, dummy '
          f'{"float32 (CPU)" if args.smoke else "bf16"} weights ({weights_gib:.1f} GiB in bf16 at TP=1); '
          f'commit {_commit()}')
    keys = [k for k in dict.fromkeys(k for r in rows for k in r) if k != 'tp']
    print('| metric | ' + ' | '.join(f'TP={r["tp"]}' for r in rows) + ' |')
    print('|---|' + '---:|' * len(rows))
    for key in keys:
        print(f'| {key} | ' + ' | '.join(str(r.get(key, '')) for r in rows) + ' |')
    for tp, table in allreduce.items():
        for tokens, v in table.items():
            how = 'no process group: every reduction point is an identity' if tp == 1 else \
                f'{v["op_us"]} us per op x {2 * layers} per step'
            print(f'all-reduce per step, TP={tp}, [{tokens}, {hidden}]: {v["per_step_ms"]} ms ({how})')
    result = {'shape': args.shape, 'layers': layers, 'experts': experts, 'weights_gib': round(weights_gib, 1),
              'commit': _commit(), 'engines': rows,
              'allreduce': {str(k): {str(t): v for t, v in tab.items()} for k, tab in allreduce.items()}}
    print(json.dumps(result), flush=True)
    return result


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child is not None:  # one engine, in a process of its own
        if args.fit_80b:
            return fit_80b(args, args.child)
        print('RESULT ' + json.dumps(measure_engine(args, args.child)), flush=True)
        return {}
    tps = [max(args.tp)] if args.fit_80b else args.tp
    with tempfile.TemporaryDirectory() as tmp:
        config = write_config(tmp, SHAPES[args.shape], args.layers)
        rows = []
        for tp in tps:
            rows.append(run_child(argv, tp, tmp))
            print(f'tp={tp}: {rows[-1]}', flush=True)
    return report(args, rows, allreduce_rows(args, tps, rows, config.hidden_size, config.num_hidden_layers), config)


def fit_80b(args, tp: int) -> dict:
    """One request (1024-token prompt, 16 tokens) on the 80B shape; rank 0's weights against one GPU's memory."""
    from lmdeploy.messages import PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine
    from lmdeploy.pytorch.models.model_init import param_bytes
    t = time.perf_counter()
    engine = Engine(args.model_dir, PytorchEngineConfig(device_type='cuda', tp=tp, load_format='dummy',
                                                        dtype='bfloat16', max_batch_size=8, session_len=4096,
                                                        enable_prefix_caching=True))
    try:
        start_s = time.perf_counter() - t
        t0, recs = run(engine, [prompt(1024, 1, engine.model_config.vocab_size)], 16)
        out = {'tp': tp, 'start_s': round(start_s, 1), 'rank0_weights_gib': round(param_bytes(engine.model) / 2**30, 1),
               'gpu_total_gib': round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
               'tokens': len(recs[0]['times']), 'ttft_ms': round((recs[0]['first'] - t0) * 1e3, 1),
               'kv_blocks': engine.cache_config.num_blocks, **collectives(engine, tp)}
    finally:
        engine.close()
    print('RESULT ' + json.dumps(out), flush=True)
    return out


if __name__ == '__main__':
    main()
