"""Where one decode step's device time goes: a real-depth model with dummy weights (`--shape`, the shapes of
`bench_real_depth.py`), decode at each of `--batches` with CUDA graphs as the engine runs them (`eager_mode=False`
unless `--eager`; async scheduling as the engine's default unless `--async-scheduling` / `--no-async-scheduling`).

Per batch, the decode window of `real_depth_rows.decode_window` (every request has its first token; each step's
forward checked a decode batch of the whole batch by the engine's per-step record) runs three times: a short warm
window, a timed one (`step`: wall ms per step, unprofiled), and one of the same length under `torch.profiler` (CPU
and CUDA activity, as `profile_prefill.py`; `--cuda-only`: no CPU-op hooks). From the profiled window:
- the kernels by total device time and by category (`kernel_profile.py`, the table of `profile_prefill.py`), with
  ms per step;
- the step against the weight roofline: bytes of weights one step reads (`real_depth_floors.ModelCost`: all but the
  embedding table, of which `batch` rows; the experts the batch touches) / the D2D copy bandwidth measured at the
  start, and the roofline counting KV read and recurrent state read and written too;
- the device's busy time per step (its activity records unioned, which the profiler does not slow down) and the host
  gap between steps: the unprofiled step less that busy time (`host_gap_ms_per_step`), and, inside the profiled
  window, the device span less its busy time over the steps (`profiled_idle_ms_per_step`, inflated by the
  profiler's own host cost) with its longest idle gaps.

Kernels inside CUDA graphs: CUPTI (torch's Kineto profiler) records every kernel node of a replayed graph as a
kernel activity of its own, with its name and device interval, while the host side shows one `cudaGraphLaunch` per
replay; so the table lists the model's kernels (GEMMs, attention, the gated delta rule, norms) of each replay, each
replay's kernels counted once per step. The script prints the kernels it saw per step; a handful (the eager input
copies and sampling only) with graphs on would mean the graph's nodes were not reported (a WARNING line says so).

    python benchmark/profile_decode.py --shape qwen3.5-9b --batches 1 32 128   # ~1 minute on an H200
    python benchmark/profile_decode.py --smoke          # tiny float32 shape on the CPU: checks the logic only

Prints the tables and, last, one JSON line.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_harness import Bench, collect_env, engine_warmup, seed_of  # noqa: E402
from bench_real_depth import SHAPES, make_config  # noqa: E402
from kernel_profile import by_category, device_intervals, idle_gaps, kernel_events, print_breakdown  # noqa: E402
from real_depth_floors import measure_device, model_cost  # noqa: E402
from real_depth_rows import SETTLE, decode_window  # noqa: E402

GRAPH_KERNELS_MIN = 20  # fewer kernels per step with CUDA graphs on: the graphs' nodes were not reported


def build_engine(args, folder: str):
    from lmdeploy.messages import PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine
    top = max(args.batches)
    new = SETTLE + args.steps + 2 * -(-top * args.context // args.max_prefill_token_num) + 4
    blocks = top * -(-(args.context + new + 1) // args.block_size) + 32
    config = PytorchEngineConfig(
        device_type=args.device, dtype=args.dtype, load_format='dummy', block_size=args.block_size,
        num_gpu_blocks=blocks, max_batch_size=top, max_prefill_token_num=args.max_prefill_token_num,
        session_len=args.session_len, enable_prefix_caching=False, eager_mode=args.eager,
        async_scheduling=args.async_scheduling)
    return Engine(folder, config)


class _Profiled:
    """`around` for `decode_window`: a torch.profiler session whose result stays readable after the window."""

    def __init__(self, on_cuda: bool, cpu: bool):
        activity = torch.profiler.ProfilerActivity
        activities = ([activity.CPU] if cpu or not on_cuda else []) + ([activity.CUDA] if on_cuda else [])
        self.prof = torch.profiler.profile(activities=activities)

    @contextlib.contextmanager
    def __call__(self):
        with self.prof:
            yield


def profile_batch(bench: Bench, engine, batch: int, cost, rates, vocab: int) -> dict:
    """The three windows at `batch` (module docstring); prints this batch's tables, returns its figures."""
    a, on_cuda = bench.args, bench.device == 'cuda'
    decode_window(bench, engine, batch, min(64, a.context), 3, seed_of('decode', batch, -1), vocab)
    timed = decode_window(bench, engine, batch, a.context, a.steps, seed_of('decode', batch, 0), vocab)
    profiled = _Profiled(on_cuda, cpu=not a.cuda_only)
    prof_res = decode_window(bench, engine, batch, a.context, a.steps, seed_of('decode', batch, 1), vocab,
                             around=profiled)
    rows = kernel_events(profiled.prof, on_cuda)
    span_us, busy_us, gaps = idle_gaps(device_intervals(profiled.prof, on_cuda))
    steps = a.steps
    context = a.context + SETTLE + steps // 2  # tokens a sequence holds in the middle of the window
    floors = {}
    for name, weights_only in (('weights', True), ('all', False)):
        nbytes = cost.decode_bytes(batch, context, weights_only=weights_only)
        floors[name] = (nbytes, nbytes / rates.copy_bytes_per_s * 1e3)
    kernels_per_step = sum(calls for _, calls, _ in rows) / steps
    res = {
        'batch': batch, 'step_ms': timed['step_ms'], 'decode_tok_s': timed['decode_tok_s'],
        'profiled_step_ms': prof_res['step_ms'], 'overlapped_steps': timed['overlapped_steps'],
        'weights_gb_per_step': floors['weights'][0] / 1e9, 'roofline_weights_ms': floors['weights'][1],
        'share_of_weight_roofline': floors['weights'][1] / timed['step_ms'],
        'roofline_all_ms': floors['all'][1], 'share_of_all_roofline': floors['all'][1] / timed['step_ms'],
        'busy_ms_per_step': busy_us / 1e3 / steps, 'host_gap_ms_per_step': timed['step_ms'] - busy_us / 1e3 / steps,
        'profiled_idle_ms_per_step': (span_us - busy_us) / 1e3 / steps,
        'longest_gaps_us': sorted(gaps, reverse=True)[:steps],
        'kernels_per_step': kernels_per_step, 'context_tokens': context,
        'categories_ms_per_step': {cat: us / 1e3 / steps for cat, us in by_category(rows).items()},
    }
    print_batch(res, rates.copy_bytes_per_s / 1e9, steps, check_graphs=on_cuda and not a.eager)
    print_breakdown(rows, prof_res['step_ms'] * steps, a.top, steps=steps)
    return res


def print_batch(res: dict, copy_gb_s: float, steps: int, check_graphs: bool) -> None:
    """The summary lines of one batch (`profile_batch`'s figures)."""
    gaps = res['longest_gaps_us']
    print(f'\n=== batch {res["batch"]}: step {res["step_ms"]:.3f} ms ({res["decode_tok_s"]:.1f} tok/s; profiled '
          f'{res["profiled_step_ms"]:.3f} ms), {res["overlapped_steps"]} of {steps} steps overlapped')
    print(f'weight roofline {res["roofline_weights_ms"]:.3f} ms ({res["weights_gb_per_step"]:.2f} GB / '
          f'{copy_gb_s:.0f} GB/s): {res["share_of_weight_roofline"]:.2f} of it; with KV and state '
          f'({res["context_tokens"]} tokens) {res["roofline_all_ms"]:.3f} ms: {res["share_of_all_roofline"]:.2f}')
    print(f'device busy {res["busy_ms_per_step"]:.3f} ms/step; host gap {res["host_gap_ms_per_step"]:.3f} ms/step '
          f'(unprofiled step - busy); profiled window idle {res["profiled_idle_ms_per_step"]:.3f} ms/step, its '
          f'{len(gaps)} longest gaps median {statistics.median(gaps) if gaps else 0.0:.1f} us; '
          f'{res["kernels_per_step"]:.0f} kernels/step')
    if check_graphs and res['kernels_per_step'] < GRAPH_KERNELS_MIN:
        print(f'WARNING: {res["kernels_per_step"]:.0f} kernels per step with CUDA graphs on: the profiler did not '
              'report the kernels inside the replayed graphs')


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--shape', choices=sorted(SHAPES), default='qwen3.5-9b')
    p.add_argument('--experts', type=int, default=64, help='experts kept of the MoE shapes (top-k unchanged)')
    p.add_argument('--batches', type=int, nargs='+', default=None)
    p.add_argument('--context', type=int, default=None, help='prompt tokens of every request')
    p.add_argument('--steps', type=int, default=None, help='decode steps per window')
    p.add_argument('--top', type=int, default=20)
    p.add_argument('--session-len', type=int, default=None, help="default: bench_real_depth's 34000 (smoke: small)")
    p.add_argument('--eager', action='store_true', help='no CUDA graphs (eager_mode=True)')
    p.add_argument('--cuda-only', action='store_true', help='profile CUDA activity only (no CPU-op records)')
    p.add_argument('--async-scheduling', action=argparse.BooleanOptionalAction, default=None,
                   help="the engine's async scheduling (default: the engine's default, on for CUDA)")
    p.add_argument('--smoke', action='store_true', help='tiny float32 shape on the CPU')
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.dtype, args.block_size, args.max_prefill_token_num = 'cpu', 'float32', 16, 128
        defaults = dict(batches=[1, 4], context=32, steps=4)
    else:
        args.device, args.dtype, args.block_size, args.max_prefill_token_num = 'cuda', 'bfloat16', 64, 8192
        defaults = dict(batches=[1, 32, 128], context=512, steps=16)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.session_len is None:  # the GPU default is bench_real_depth's (the width of the graphs' block tables)
        args.session_len = 34000 if not args.smoke else args.context + args.steps + 64 + \
            2 * -(-max(args.batches) * args.context // args.max_prefill_token_num)
    args.out, args.time_budget, args.request_timeout = None, 0.0, 300.0
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.device == 'cuda' and not torch.cuda.is_available():
        raise SystemExit('profile_decode needs a CUDA device (or --smoke for the CPU logic check)')
    bench = Bench(args)
    config, _, _ = make_config(argparse.Namespace(shape=args.shape, experts=args.experts, smoke=args.smoke))
    dtype = getattr(torch, args.dtype)
    cost = model_cost(config, weight_bytes=torch.empty((), dtype=dtype).element_size())
    rates = measure_device(torch.device(args.device), dtype, *((16, 256, 3) if args.smoke else (2048, 8192, 10)))
    env = collect_env(bench)
    bench.log(f'{args.shape}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, '
              f'{cost.total_params / 1e9:.2f}B params; commit {os.environ.get("LMDEPLOY_COMMIT", "?")}; '
              f'copy {rates.copy_bytes_per_s / 1e9:.0f} GB/s; ' + ', '.join(f'{k}={v}' for k, v in env.items()))
    results = []
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        t = time.perf_counter()
        engine = build_engine(args, folder)
        bench.log(f'engine started in {time.perf_counter() - t:.1f}s (CUDA graphs '
                  f'{"off" if args.eager or args.device != "cuda" else "on"}, async scheduling '
                  f'{"on" if engine.async_scheduling else "off"})')
        engine_warmup(bench, engine, config.vocab_size)
        for batch in args.batches:
            results.append(profile_batch(bench, engine, batch, cost, rates, config.vocab_size))
        engine.check_integrity()
        engine.close()
    summary = dict(bench='profile_decode', shape=args.shape, smoke=args.smoke, async_scheduling=engine.async_scheduling,
                   graphs=not args.eager and args.device == 'cuda', copy_gb_s=rates.copy_bytes_per_s / 1e9,
                   env=env, results=results)
    print(json.dumps(summary, default=str), flush=True)
    return summary


if __name__ == '__main__':
    main()
