"""Issue #18's real-depth benchmark: the engine against transformers + fla and against the device floor, on
real-depth Qwen3.5 / Qwen3-Next shapes with random bf16 weights, every ratio of the issue's "Done when" in one run.

Shapes are transformers' default configs (`--shape`):
  - `qwen3.5-9b`: `Qwen3_5TextConfig()` (32 layers, hidden 4096, dense MLP 12288);
  - `qwen3.5-35b-a3b`: `Qwen3_5MoeTextConfig()` (40 layers, hidden 2048, top-8), `--experts` of the 256 kept;
  - `qwen3-next-80b`: `Qwen3NextConfig()` (48 layers, hidden 2048, top-10), `--experts` of the 512 kept.
Depth and widths are the release's; fewer experts keep both copies on one GPU (the floors count the model run).
`max_position_embeddings` is raised to 65536 so a 32K prompt plus its suffix fits (no weight depends on it).

Both systems live on the device at once, no disk writes: the engine from a config-only folder with
`load_format='dummy'` (random weights drawn on the device), transformers from the same config under
`torch.device('cuda')` in bf16 (its random init; fla's kernels where installed). The weights differ, which does not
matter for timing: token counts are fixed (greedy, no eos, exactly `max_new_tokens`). transformers is built first,
so the engine sizes its KV pool (`--cache-max-entry-count` of the memory left) next to it.

Order (a `--time-budget` skips what would start after it; `--out` is rewritten after every row):
  0. floors: the device's D2D copy bandwidth and bf16 torch.mm rate (`real_depth_floors.measure_device`);
  1. engine, prefix caching on: start-up time, then the first request after start-up against a later request of
     the same length (1K prompt, 8 new tokens; nothing ran before: transformers is built but has not run, since it
     shares fla's Triton kernels), then warm-up; TTFT of a 100-token suffix after a cached, non-block-aligned
     prefix (engine: the prefix request first, then prefix + suffix timed; transformers: the suffix forward on its
     own cache of the prefix), cold TTFT with the cache on;
  2. engine, prefix caching off (the first engine freed first): cold TTFT (transformers: one forward,
     `logits_to_keep=1`, + argmax), decode tokens/s at batch 1 / 32 / 128 timed without the prefill (engine: a
     window of steps after every request has its first token, each step's forward checked a decode batch of the
     whole batch by the engine's per-step record, async scheduling or not: `real_depth_rows.py`; transformers: its
     forward loop on its cache), and the continuous-batching run (`real_depth_serving.py`: throughput, TTFT / ITL
     percentiles, device busy share).
TTFT rows: median of `--reps` after one untimed repetition, wall clock with the device synchronised.

    python benchmark/bench_real_depth.py --shape qwen3.5-9b --out /tmp/real_depth_9b.md
    python benchmark/bench_real_depth.py --smoke          # tiny float32 shape on the CPU: checks the logic only

Prints progress, the markdown report and, last, one JSON line.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_shapes  # noqa: E402
from bench_harness import (  # noqa: E402 - the shared helpers beside this script
    HF,
    Bench,
    collect_env,
    engine_warmup,
    make_prompt,
    measure_cold,
    measure_suffix,
)
from real_depth_floors import DeviceRates, ModelCost, measure_device, model_cost  # noqa: E402
from real_depth_report import render_report  # noqa: E402
from real_depth_rows import continuous, engine_decode, first_vs_later, hf_decode  # noqa: E402

# shape -> (transformers config class, causal-LM class, release expert count)
SHAPES = {
    'qwen3.5-9b': ('Qwen3_5TextConfig', 'Qwen3_5ForCausalLM', 0),
    'qwen3.5-35b-a3b': ('Qwen3_5MoeTextConfig', 'Qwen3_5MoeForCausalLM', 256),
    'qwen3-next-80b': ('Qwen3NextConfig', 'Qwen3NextForCausalLM', 512),
}
SMOKE_WIDTHS = dict(bench_shapes.SMOKE_WIDTHS, vocab_size=512)
ROWS = ('startup', 'suffix', 'cold', 'decode', 'cb')


def make_config(args: argparse.Namespace):
    """The shape's default transformers config, with the experts kept and (smoke) tiny widths."""
    import inspect

    import transformers
    cls_name, model_name, release_experts = SHAPES[args.shape]
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        raise SystemExit(f'transformers {transformers.__version__} has no {cls_name} (needed for --shape {args.shape})')
    kwargs = dict(max_position_embeddings=65536)
    if release_experts:
        kwargs['num_experts'] = args.experts
    if args.smoke:
        kwargs.update(SMOKE_WIDTHS)
        if release_experts:
            kwargs['num_experts'] = 8
    accepted = set(inspect.signature(cls.__init__).parameters)
    config = cls(**{k: v for k, v in kwargs.items() if k in accepted or k == 'max_position_embeddings'})
    config.architectures = [model_name]
    config.max_position_embeddings = kwargs['max_position_embeddings']
    kept = {k: getattr(config, k, None) for k in kwargs if k in ('num_experts', 'hidden_size', 'num_hidden_layers')}
    if kept != {k: kwargs[k] for k in kept}:  # a transformers version that ignores a width would mis-size both models
        raise SystemExit(f'{cls_name} did not take {kwargs}: got {kept}')
    return config, model_name, release_experts


def build_hf_model(config, model_name: str, device: str, dtype: torch.dtype):
    """transformers' random init directly on the device, in `dtype` (no checkpoint)."""
    import transformers
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = getattr(transformers, model_name)(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def build_engine(bench: Bench, folder: str, prefix_caching: bool):
    from lmdeploy.messages import PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine
    a = bench.args
    config = PytorchEngineConfig(
        device_type=bench.device, dtype=a.dtype, load_format='dummy', block_size=a.block_size,
        cache_max_entry_count=a.cache_max_entry_count, num_gpu_blocks=a.num_blocks, max_batch_size=a.max_batch_size,
        max_prefill_token_num=a.max_prefill_token_num, session_len=a.session_len,
        enable_prefix_caching=prefix_caching, async_scheduling=a.async_scheduling)
    t = time.perf_counter()
    engine = Engine(folder, config)
    startup = time.perf_counter() - t
    bench.env['async_scheduling'] = engine.async_scheduling
    bench.log(f'engine (prefix caching {"on" if prefix_caching else "off"}, async scheduling '
              f'{"on" if engine.async_scheduling else "off"}) started in {startup:.1f}s: '
              f'{engine.cache_config.num_blocks} KV blocks of {engine.cache_config.block_size}, '
              f'{engine.cache_config.num_state_slots} state rows, session_len {engine.session_len}')
    return engine, startup


# ----------------------------------------------------------------------------------------------------------------
# phases
# ----------------------------------------------------------------------------------------------------------------
class RealDepthBench(Bench):
    """The harness plus this run's model, costs and device rates (what the report needs)."""

    cost: ModelCost | None = None
    rates: DeviceRates | None = None
    shape_info: dict
    argv: list[str]

    def render(self) -> str:
        return render_report(self)

    def write_report(self) -> None:
        super().write_report()
        if self.args.state_json:  # what the next phase's process starts from
            state = dict(results=self.results, env=self.env,
                         rates=None if self.rates is None else dataclasses.asdict(self.rates))
            with open(self.args.state_json, 'w') as f:
                json.dump(state, f, default=str)

    def load_state(self, path: str | None = None) -> None:
        path = path or self.args.state_json
        if not path or not os.path.isfile(path):
            return
        with open(path) as f:
            state = json.load(f)
        self.results.update(state['results'])
        self.env.update({k: v for k, v in state['env'].items() if k != 'command'})
        if state.get('rates'):
            self.rates = DeviceRates(**state['rates'])


def phase_keys(bench: RealDepthBench, prefix_caching: bool, first: bool) -> list[str]:
    a, rows = bench.args, bench.args.rows
    if prefix_caching:
        keys = ['engine.startup'] if first and 'startup' in rows else []
        keys += [f'engine_pc_on.suffix.{n}' for n in a.prefix_sizes] if 'suffix' in rows else []
        return keys + ([f'engine_pc_on.cold.{n}' for n in a.cold_sizes] if 'cold' in rows else [])
    keys = ['engine.startup'] if first and 'startup' in rows else []
    keys += [f'engine_pc_off.cold.{n}' for n in a.cold_sizes] if 'cold' in rows else []
    keys += [f'engine.decode.{b}' for b in a.decode_batches] if 'decode' in rows else []
    return keys + (['engine.cb'] if 'cb' in rows else [])


def run_phase(bench: RealDepthBench, folder: str, hf: HF | None, prefix_caching: bool, first: bool,
              vocab: int) -> bool:
    """One engine's rows (and transformers' rows paired with them); False when no engine could be built."""
    keys = phase_keys(bench, prefix_caching, first)
    if not keys:
        return False
    if bench.over_budget():
        bench.skip_all(keys)
        return False
    tag = 'engine_pc_on' if prefix_caching else 'engine_pc_off'
    try:
        engine, startup_s = build_engine(bench, folder, prefix_caching)
    except Exception as exc:  # noqa: BLE001 - recorded, the other phase still runs
        traceback.print_exc()
        bench.fail_all(keys, 'engine start-up', exc)
        bench.free()
        return False
    bench.results[f'{tag}.startup'] = {'startup_s': startup_s}
    try:
        phase_rows(bench, engine, hf, tag, startup_s if first else None, vocab)
        engine.check_integrity()
    except Exception as exc:  # noqa: BLE001 - a warm-up or integrity failure: what is left is recorded as failed
        traceback.print_exc()
        bench.fail_all(keys, f'{tag} warm-up / integrity check', exc)
    engine = None  # the pool goes before the next engine sizes its own
    bench.free()
    if bench.device == 'cuda':
        bench.log(f'{tag} freed: {torch.cuda.memory_allocated() / 2**30:.1f} GiB still allocated')
    return True


def phase_rows(bench: RealDepthBench, engine, hf: HF | None, tag: str, startup_s: float | None, vocab: int) -> None:
    """The rows of one engine, in priority order; `startup_s` given: this is the process's first engine."""
    a, rows = bench.args, bench.args.rows
    if startup_s is not None and 'startup' in rows:
        bench.measure('engine.startup', lambda: first_vs_later(bench, engine, startup_s, vocab))
    engine_warmup(bench, engine, vocab)
    if hf is not None and not getattr(hf, 'warmed', False):
        with torch.inference_mode():
            hf.timed_forward(hf.ids([make_prompt(64, 7, vocab)]))
        hf.warmed = True
    cache_on = tag == 'engine_pc_on'
    for n in a.prefix_sizes if cache_on and 'suffix' in rows else []:
        measure_suffix(bench, tag, engine, hf, n, vocab)
    for n in a.cold_sizes if 'cold' in rows else []:
        measure_cold(bench, tag, engine, None if cache_on else hf, n, vocab)
    if cache_on:
        return
    for b in a.decode_batches if 'decode' in rows else []:
        bench.measure(f'engine.decode.{b}', lambda b=b: engine_decode(bench, engine, b, vocab))
        if hf is not None:
            bench.measure(f'hf.decode.{b}', lambda b=b: hf_decode(hf, b, vocab))
    if 'cb' in rows:
        bench.measure('engine.cb', lambda: continuous(bench, engine, vocab))
    if a.compare_sync and engine.async_scheduling:  # the same engine with the synchronous loop (idle: switchable)
        engine.async_scheduling = False
        for b in a.decode_batches if 'decode' in rows else []:
            bench.measure(f'engine_sync.decode.{b}', lambda b=b: engine_decode(bench, engine, b, vocab))
        if 'cb' in rows:
            bench.measure('engine_sync.cb', lambda: continuous(bench, engine, vocab))
        engine.async_scheduling = True


def run_all(bench: RealDepthBench) -> None:
    a = bench.args
    config, model_name, release_experts = make_config(a)
    dtype = getattr(torch, a.dtype)
    bench.cost = model_cost(config, weight_bytes=torch.empty((), dtype=dtype).element_size())
    bench.shape_info = dict(shape=a.shape, config_class=SHAPES[a.shape][0], model=model_name,
                            layers=config.num_hidden_layers, hidden=config.hidden_size,
                            experts=getattr(config, 'num_experts', 0) or 0, release_experts=release_experts,
                            top_k=getattr(config, 'num_experts_per_tok', 0) or 0, vocab=config.vocab_size)
    if a.phase == 'all' and a.isolate:
        run_isolated(bench)
        return
    bench.load_state()
    if bench.rates is None:
        device = torch.device(bench.device)
        bench.rates = measure_device(device, dtype, *((16, 256, 3) if a.smoke else (2048, 8192, 10)))
    bench.log(f'device: copy {bench.rates.copy_bytes_per_s / 1e9:.0f} GB/s, '
              f'matmul {bench.rates.matmul_flops_per_s / 1e12:.1f} TFLOP/s; model {bench.cost.total_params / 1e9:.2f}B')
    bench.write_report()
    hf = None
    if 'hf' in a.systems:
        t = time.perf_counter()
        try:
            hf = HF(bench, build_hf_model(config, model_name, bench.device, dtype))
            bench.env['hf_init_s'] = round(time.perf_counter() - t, 1)
            bench.env['hf_attn'] = str(getattr(hf.model.config, '_attn_implementation', '?'))
            bench.env['hf_experts'] = str(getattr(hf.model.config, '_experts_implementation', '?'))
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            bench.log(f'transformers build failed: {exc}')
            bench.env['hf_error'] = f'{type(exc).__name__}: {exc}'[:300]
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        if 'engine' in a.systems:
            first = 'engine.startup' not in bench.results
            if a.phase in ('all', 'on'):
                first = not run_phase(bench, folder, hf, True, first, vocab=config.vocab_size) and first
            if a.phase in ('all', 'off'):
                run_phase(bench, folder, hf, False, first, vocab=config.vocab_size)
    del hf
    bench.free()


def run_isolated(bench: RealDepthBench) -> None:
    """Each engine phase in a process of its own (transformers rebuilt in each: a fraction of a second), so a
    device fault of one engine cannot take the other's rows with it; the results travel through `--state-json`."""
    a = bench.args
    with tempfile.TemporaryDirectory() as tmp:
        state = os.path.join(tmp, 'state.json')
        for phase in ('on', 'off'):
            extra = ['--phase', phase, '--state-json', state]
            if a.time_budget > 0:
                left = a.time_budget - (time.perf_counter() - bench.t_start)
                if left <= 0:
                    break
                extra += ['--time-budget', f'{left:.0f}']
            cmd = [sys.executable, os.path.abspath(__file__), *bench.argv, *extra]
            bench.log(f'phase {phase}: {" ".join(cmd[1:])}')
            child = subprocess.Popen(cmd)
            try:
                rc = child.wait()
            finally:
                if child.poll() is None:  # the parent was interrupted (an outer timeout): take the child with it
                    child.kill()
            if rc:
                bench.log(f'phase {phase} exited with {rc}')
            bench.load_state(state)
            bench.write_report()


# ----------------------------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--shape', choices=sorted(SHAPES), default='qwen3.5-9b')
    p.add_argument('--rows', nargs='+', choices=ROWS, default=list(ROWS), help='a subset of the rows')
    p.add_argument('--systems', nargs='+', choices=['engine', 'hf'], default=['engine', 'hf'])
    p.add_argument('--smoke', action='store_true', help='tiny float32 shape on the CPU at tiny sizes')
    p.add_argument('--out', default=None, help='markdown report, rewritten after every row')
    p.add_argument('--time-budget', type=float, default=0.0, help='seconds; rows starting later are skipped')
    p.add_argument('--experts', type=int, default=64, help='experts kept of the MoE shapes (top-k unchanged)')
    p.add_argument('--reps', type=int, default=3)
    p.add_argument('--cold-sizes', type=int, nargs='*', default=None)
    p.add_argument('--prefix-sizes', type=int, nargs='*', default=None, help='non-block-aligned on purpose')
    p.add_argument('--suffix-len', type=int, default=None)
    p.add_argument('--decode-batches', type=int, nargs='*', default=None)
    p.add_argument('--decode-prompt-len', type=int, default=None)
    p.add_argument('--decode-steps', type=int, default=None)
    p.add_argument('--first-request-len', type=int, default=None)
    p.add_argument('--cb-requests', type=int, default=None)
    p.add_argument('--cb-rate', type=float, default=None, help='requests per second (Poisson arrivals)')
    p.add_argument('--cb-prompt-len', type=int, nargs=2, default=None, metavar=('MIN', 'MAX'))
    p.add_argument('--cb-output-len', type=int, nargs=2, default=None, metavar=('MIN', 'MAX'))
    p.add_argument('--block-size', type=int, default=None)
    p.add_argument('--cache-max-entry-count', type=float, default=0.15,
                   help='share of the memory left after both models and the state pool given to the KV pool')
    p.add_argument('--num-blocks', type=int, default=None, help='KV blocks (0: sized from memory)')
    p.add_argument('--max-batch-size', type=int, default=None)
    p.add_argument('--max-prefill-token-num', type=int, default=None)
    p.add_argument('--session-len', type=int, default=None)
    p.add_argument('--request-timeout', type=float, default=300.0)
    p.add_argument('--async-scheduling', action=argparse.BooleanOptionalAction, default=None,
                   help="the engine's async scheduling (default: the engine's default, on for CUDA)")
    p.add_argument('--compare-sync', action='store_true',
                   help='also run the decode and cb rows with async scheduling off, on the same engine')
    p.add_argument('--phase', choices=['all', 'on', 'off'], default='all',
                   help='which engine runs: prefix caching on, off, or both in turn')
    p.add_argument('--isolate', action=argparse.BooleanOptionalAction, default=None,
                   help='run each engine phase in its own process (default: on the GPU, not with --smoke)')
    p.add_argument('--state-json', default=None, help='(between phase processes) results to start from and update')
    args = p.parse_args(argv)
    if args.isolate is None:
        args.isolate = not args.smoke
    if args.smoke:
        defaults = dict(cold_sizes=[64, 160], prefix_sizes=[50, 100], suffix_len=12, decode_batches=[1, 4],
                        decode_prompt_len=32, decode_steps=4, first_request_len=64, cb_requests=10, cb_rate=200.0,
                        cb_prompt_len=[16, 64], cb_output_len=[2, 6], block_size=16, num_blocks=512,
                        max_batch_size=8, max_prefill_token_num=128, session_len=1024)
        args.device, args.dtype, args.check_hf_cache = 'cpu', 'float32', True
    else:
        defaults = dict(cold_sizes=[1024, 8192, 32768], prefix_sizes=[1000, 8100, 32700], suffix_len=100,
                        decode_batches=[1, 32, 128], decode_prompt_len=512, decode_steps=32, first_request_len=1024,
                        cb_requests=200, cb_rate=10.0, cb_prompt_len=[256, 4096], cb_output_len=[32, 256],
                        block_size=64, num_blocks=0, max_batch_size=128, max_prefill_token_num=8192,
                        session_len=34000)
        args.device, args.dtype, args.check_hf_cache = 'cuda', 'bfloat16', False
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    aligned = [n for n in args.prefix_sizes if n % args.block_size == 0]
    if aligned:
        p.error(f'--prefix-sizes {aligned} are block-aligned (block {args.block_size}); the row wants unaligned')
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.device == 'cuda' and not torch.cuda.is_available():
        raise SystemExit('bench_real_depth needs a CUDA device (or --smoke for the CPU logic check)')
    bench = RealDepthBench(args)
    bench.argv = list(argv if argv is not None else sys.argv[1:])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # an outer timeout: unwind (and kill a phase child)
    bench.shape_info = {'shape': args.shape}
    bench.env = collect_env(bench)
    bench.env['command'] = ' '.join(['python', 'benchmark/bench_real_depth.py', *(argv if argv is not None
                                                                                  else sys.argv[1:])])
    bench.log('env: ' + ', '.join(f'{k}={v}' for k, v in bench.env.items()))
    run_all(bench)
    if args.state_json:  # a phase process: the parent prints the merged report
        bench.write_report()
        return {'results': bench.results}
    md = render_report(bench)
    print(md)
    bench.write_report()
    summary = dict(bench='real_depth', shape=args.shape, smoke=args.smoke, env=bench.env, results=bench.results,
                   elapsed_s=round(time.perf_counter() - bench.t_start, 1))
    print(json.dumps(summary, default=str), flush=True)
    return summary


if __name__ == '__main__':
    main()
