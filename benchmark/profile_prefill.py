"""Where one cold long prefill spends its time: a real-depth model with dummy weights (`--shape`, the shapes of
`bench_real_depth.py`), one cold `--tokens`-token prompt (the engine's forwards of `max_prefill_token_num` tokens)
under `torch.profiler`, and a breakdown of the device kernels (`kernel_profile.py`):
- the top `--top` kernels by total device time (calls, total ms, share of the profiled wall time);
- the same time by category (GEMM, gated delta rule, conv, attention, MoE, norm / rotary, copies, other) and the
  share of wall time the device was busy at all.
The run before the profiled one compiles and autotunes everything (it is timed too, unprofiled: `warm-up` and
`timed` lines). Prefills of this size run eagerly whatever `eager_mode` says, so the engine starts with
`eager_mode=True` (no decode-graph capture at start-up) unless `--graphs`.

    python benchmark/profile_prefill.py                       # Qwen3.5-9B shape, 32K tokens, ~1 minute on an H200
    python benchmark/profile_prefill.py --shape qwen3.5-35b-a3b --tokens 8192
    python benchmark/profile_prefill.py --smoke               # tiny float32 shape on the CPU: checks the logic only
    python benchmark/profile_prefill.py --prefix 32700 --tokens 100 --graphs   # a suffix after a cached prefix

With `--prefix P` each request is first a P-token prompt (untimed: it fills the prefix cache), then the same prompt
plus `--tokens` new ones, timed and profiled: the TTFT of a suffix after a cached prefix, as `bench_real_depth.py`'s
suffix rows run it (pass `--graphs` for their engine). `--host-top` lists the host ops of the profiled run by self
time too (a host stall, e.g. a synchronisation or an allocation, shows there and not among the kernels), `--gaps N`
the device's span and busy time in the profiled window and its N longest idle gaps, with the activities around
each (the H200 run 17 suffix after 32,700 tokens: 19.4 ms TTFT for 11.5 ms of kernels), `--phases` the engine's
named host phases (`engine/trace.py`) in order with the device's busy time inside each, `--cprofile N` more
requests under cProfile (`--cprofile-reps`, default 10; N functions by own time, then by cumulative time, in us per
request: host costs without CUPTI's),
`--host-times N` N more requests with no profiler at all, the engine's host phases timed by `time.perf_counter`
around its own calls (each phase's start after the request's arrival and its host time, median: what `--phases`
shows without the profiler's cost per torch op), `--launch` the host time of each captured graph's launch.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_harness import Bench, engine_run, make_prompt  # noqa: E402
from bench_real_depth import SHAPES, make_config  # noqa: E402
from kernel_profile import kernel_events, print_breakdown, print_host_ops, print_phases, print_timeline  # noqa: E402


def build_engine(args, folder: str):
    from lmdeploy.messages import PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine
    session_len = args.prefix + args.tokens + 64
    # the cached prefixes of the warm-up, timed and profiled requests stay in the pool beside the running one
    # (`--num-blocks`: a larger pool, so that no admission evicts, as in bench_real_depth's rows)
    blocks = args.num_blocks or 4 * -(-session_len // args.block_size) + 8
    config = PytorchEngineConfig(
        device_type=args.device, dtype=args.dtype, load_format='dummy', block_size=args.block_size,
        num_gpu_blocks=blocks, max_batch_size=args.max_batch_size, max_prefill_token_num=args.max_prefill_token_num,
        session_len=session_len, eager_mode=not args.graphs, enable_prefix_caching=args.prefix > 0)
    return Engine(folder, config)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--shape', choices=sorted(SHAPES), default='qwen3.5-9b')
    p.add_argument('--experts', type=int, default=64, help='experts kept of the MoE shapes (top-k unchanged)')
    p.add_argument('--tokens', type=int, default=32768)
    p.add_argument('--max-prefill-token-num', type=int, default=8192)
    p.add_argument('--block-size', type=int, default=64)
    p.add_argument('--max-batch-size', type=int, default=4)
    p.add_argument('--num-blocks', type=int, default=0, help='KV pool blocks (0: four sessions\' worth; the timed '
                   'requests then evict the earlier prefixes, which `schedule` pays for)')
    p.add_argument('--prefix', type=int, default=0, help='cached prefix before the --tokens timed ones (0: cold)')
    p.add_argument('--top', type=int, default=25)
    p.add_argument('--host-top', type=int, default=0, help='also list this many host ops by self time')
    p.add_argument('--gaps', type=int, default=0, help="also print the device's span, busy time and longest gaps")
    p.add_argument('--cprofile', type=int, default=0, help='also run --cprofile-reps more requests under cProfile and '
                   'list this many functions by own and by cumulative time, us per request (host time without the '
                   'CUDA profiler\'s per-launch cost)')
    p.add_argument('--cprofile-reps', type=int, default=10, help='requests --cprofile times')
    p.add_argument('--host-times', type=int, default=0, help='also run this many more requests without a profiler '
                   "and list the engine's host phases (start and wall time, median)")
    p.add_argument('--launch', action='store_true', help='also time the host side of replaying each prefill graph '
                   'and a few decode graphs (cudaGraphLaunch), after the profiled requests')
    p.add_argument('--phases', action='store_true', help="also list the engine's host phases and the device's "
                   'busy time inside each')
    p.add_argument('--graphs', action='store_true', help='capture decode graphs at start-up (eager_mode=False)')
    p.add_argument('--smoke', action='store_true', help='tiny float32 shape on the CPU')
    args = p.parse_args(argv)
    args.device, args.dtype = ('cpu', 'float32') if args.smoke else ('cuda', 'bfloat16')
    if args.smoke:
        args.tokens, args.max_prefill_token_num, args.block_size = 200, 64, 16
    return args


def run_requests(bench: Bench, engine, request, seeds: range, before, after) -> tuple[list[float], list[int]]:
    """One request per seed, each readied by `request(seed)` first (untimed), `before()` just before it runs and
    `after(t0)` just after (t0: its arrival); returns their TTFTs (ms) and cached token counts."""
    ttfts, cached = [], []
    for seed in seeds:
        prompt = request(seed)
        before()
        t0, (rec,) = engine_run(bench, engine, [prompt], 1)
        after(t0)
        ttfts.append((rec.first - t0) * 1e3)
        cached.append(rec.num_cached)
    return ttfts, cached


def host_profile(bench: Bench, engine, request, seeds: range, what: str, top: int) -> None:
    """More requests under cProfile, one per seed (`request(seed)` readies each, unprofiled): the host functions by
    own time (a C call's time includes its waits: a synchronisation's is the device's), then by cumulative time
    (which phase of the step they belong to), in microseconds per request: pstats' own listing rounds to
    milliseconds, coarser than most of a suffix request's host phases."""
    profile = cProfile.Profile()
    ttfts, cached = run_requests(bench, engine, request, seeds, before=profile.enable,
                                 after=lambda t0: profile.disable())
    reps = len(seeds)
    bench.log(f'cProfiled: {what}-token TTFT median {statistics.median(ttfts):.1f} ms over {reps} requests '
              f'(cached {min(cached)}-{max(cached)})')
    rows = [(tt, ct, nc, f'{os.path.basename(path)}:{line}({name})')
            for (path, line, name), (_, nc, tt, ct, _) in pstats.Stats(profile).stats.items()]
    for title, col in (('own', 0), ('cumulative', 1)):
        print(f'\nhost functions by {title} time under cProfile, per request ({reps} requests)')
        print(f'{"own us":>9s} {"cum us":>9s} {"calls":>8s}  function')
        for tt, ct, nc, name in sorted(rows, key=lambda r: -r[col])[:top]:
            print(f'{tt / reps * 1e6:9.1f} {ct / reps * 1e6:9.1f} {nc / reps:8.1f}  {name}')


def host_times(bench: Bench, engine, request, seeds: range, what: str) -> None:
    """The host phases of requests run without any profiler: each phase's start (from the request's arrival) and
    wall time, median over one request per seed, from `time.perf_counter` around the engine's own calls (the first
    call of each phase per request; CUDA calls return once queued, so a phase's time is its host time).
    `request(seed)` readies each prompt just before it is timed (its prefix cached just then: a pool sized for a
    few prefixes would evict earlier ones if all were readied first)."""
    agent = engine.agent
    phases = [('add_request', engine, 'add_request'), ('schedule', engine.scheduler, 'schedule'),
              ('make_inputs', engine.inputs_maker, 'make_cache_inputs'), ('make_inputs', engine.inputs_maker, 'make'),
              ('upload', agent, '_upload_plain'), ('restore', agent, 'restore')]
    if getattr(agent, 'graph_runner', None) is not None:
        phases.append(('graph', agent.graph_runner, 'run'))
    phases += [('sample', agent, '_sample'), ('save', agent, 'save')]
    marks: dict[str, list[float]] = {}
    originals = []

    def wrap(name, owner, attr):
        original = getattr(owner, attr)
        originals.append((owner, attr, original))

        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if name not in marks or name == 'make_inputs' and len(marks[name]) == 2:
                    marks.setdefault(name, []).extend((began, time.perf_counter()))
        setattr(owner, attr, timed)

    for name, owner, attr in phases:
        wrap(name, owner, attr)
    rows: dict[str, list[tuple[float, float]]] = {}

    def collect(t0: float) -> None:
        for name, times in marks.items():
            spans = list(zip(times[::2], times[1::2]))
            rows.setdefault(name, []).append(((spans[0][0] - t0) * 1e3, sum(b - a for a, b in spans) * 1e3))
    try:
        ttfts, cached = run_requests(bench, engine, request, seeds, before=marks.clear, after=collect)
    finally:
        for owner, attr, original in reversed(originals):
            setattr(owner, attr, original)
    print(f'\nhost phases, no profiler ({what}-token TTFT median {statistics.median(ttfts):.2f} ms over '
          f'{len(seeds)} requests, cached {min(cached)}-{max(cached)} tokens)')
    print(f'{"phase":12s} {"from_ms":>8s} {"host_ms":>8s}')
    for name in dict.fromkeys(n for n, _, _ in phases):
        if name in rows:
            starts, took = zip(*rows[name])
            print(f'{name:12s} {statistics.median(starts):8.3f} {statistics.median(took):8.3f}')


def print_graph_launches(engine, reps: int = 7) -> None:
    """Host ms of `graph.replay()` (the launch: a split prefill graph launches its pieces, the device starting on
    the first while the host launches the rest) and the replay's whole time, median of `reps`, for every prefill
    graph and decode graphs of 1, 8, 32 and 128 sequences, each on all-padding inputs."""
    runner = getattr(engine.agent, 'graph_runner', None)
    if runner is None or not runner.graphs:
        print('\nno CUDA graphs captured')
        return
    print(f'\n{"graph":28s} {"pieces":>6s} {"launch host ms":>15s} {"replay ms":>10s}')
    for key, (graph, _) in sorted(runner.graphs.items(), key=lambda kv: (kv[0].decode, kv[0].num_tokens)):
        if key.decode and key.num_seqs not in (1, 8, 32, 128):
            continue
        launch, total = [], []
        runner.fill_padding(key)
        for _ in range(reps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            graph.replay()
            launch.append(time.perf_counter() - t)
            torch.cuda.synchronize()
            total.append(time.perf_counter() - t)
        name = f'{"decode" if key.decode else "prefill"} {key.num_tokens} tok / {key.num_seqs} seq'
        pieces = len(graph) if hasattr(graph, '__len__') else 1
        print(f'{name:28s} {pieces:6d} {statistics.median(launch) * 1e3:15.3f} {statistics.median(total) * 1e3:10.3f}')


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out, args.time_budget, args.request_timeout = None, 0.0, 300.0
    bench = Bench(args)
    config, _, _ = make_config(argparse.Namespace(shape=args.shape, experts=args.experts, smoke=args.smoke))
    vocab = config.vocab_size
    bench.log(f'{args.shape}: {config.num_hidden_layers} layers, hidden {config.hidden_size}; commit '
              f'{os.environ.get("LMDEPLOY_COMMIT", "?")}, device '
              f'{torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}')
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        t = time.perf_counter()
        engine = build_engine(args, folder)
        bench.log(f'engine started in {time.perf_counter() - t:.1f}s')
        what = f'{args.tokens}-token suffix after a cached {args.prefix}' if args.prefix else f'cold {args.tokens}'

        def request(seed: int):
            prompt = make_prompt(args.prefix + args.tokens, seed, vocab)
            if args.prefix:
                engine_run(bench, engine, [prompt[:args.prefix]], 1)
            return prompt

        for name, seed in (('warm-up', 1), ('timed', 2)):
            t0, (rec,) = engine_run(bench, engine, [request(seed)], 1)
            bench.log(f'{name}: {what}-token TTFT {(rec.first - t0) * 1e3:.1f} ms (cached {rec.num_cached})')
        prompt = request(3)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if args.device == 'cuda':
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            t0, (rec,) = engine_run(bench, engine, [prompt], 1)
            wall_ms = (time.perf_counter() - t0) * 1e3
        bench.log(f'profiled: {what}-token TTFT {(rec.first - t0) * 1e3:.1f} ms (cached {rec.num_cached})')
        print_breakdown(kernel_events(prof, args.device == 'cuda'), wall_ms, args.top)
        if args.host_top:
            print_host_ops(prof, args.host_top)
        if args.gaps:
            print_timeline(prof, args.device == 'cuda', wall_ms, args.gaps)
        if args.phases:
            print_phases(prof, args.device == 'cuda')
        if args.cprofile:
            host_profile(bench, engine, request, range(100, 100 + args.cprofile_reps), what, args.cprofile)
        if args.host_times:
            host_times(bench, engine, request, range(10, 10 + args.host_times), what)
        if args.launch:
            print_graph_launches(engine)
        engine.close()


if __name__ == '__main__':
    main()
