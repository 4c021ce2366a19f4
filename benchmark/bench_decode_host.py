"""Where the host time of one engine step goes, with the model forward stubbed out (CPU).

A decode step on the GPU replays a CUDA graph; what the device cannot hide is the engine's own host work around it.
This bench isolates that work: the model's forward returns zeros of the right shape at once, so an engine step is
scheduling, input building, sampling inputs, the copies, sampling a tiny vocabulary, and the bookkeeping after it.
Each phase is timed by wrapping the engine's own calls (per step, mean over the timed steps); `other` is the rest
of the step's wall time (the step's own glue: outputs, feeds, batch records).

Two workloads:
- decode rows (`--batches`): every sequence decoding, at each batch size, async scheduling off and on (on the CPU the
  device runs inline, so "on" only shows the reordering's cost);
- a continuous-batching mix (`--mix-requests N`, prefix caching on): requests arrive as a Poisson process in steps,
  with mixed prompt and output lengths like `bench_real_depth.py`'s `cb` row (a share `--mix-shared` of them resend
  an earlier prompt's non-aligned prefix, so matches, restores and checkpoint saves happen), so steps carry prefill
  chunks beside decodes. Its table splits steps that carry a prefill chunk from pure decode steps.

The model (stubbed), logits and sample rows are device work on a GPU (kernel launches there); the rest is host time.

The mix also reports the cyclic garbage collector's passes during its steps (count, longest and total pause per
generation) and the longest step: a full (generation-2) pass walks every tracked object and lands inside whichever
step triggers it. The mix runs as the server does, its start-up heap frozen (`engine/gc_freeze.py`);
`--no-gc-freeze` runs it unfrozen for the comparison.

    python benchmark/bench_decode_host.py [--batches 1 32 128] [--steps 50] [--mix-requests 150] [--repeat 7]
    python benchmark/bench_decode_host.py --batches --mix-requests 400 --async-scheduling [--no-gc-freeze]
"""
from __future__ import annotations

import argparse
import collections
import gc
import random
import tempfile
import time

import torch

from lmdeploy.demo_model import save_tiny_model
from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine import engine_step as engine_step_module
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.engine.gc_freeze import freeze_heap, release_heap
from lmdeploy.pytorch.messages import SamplingParams

# Phases every step that runs a forward passes through (`other` is the step's wall time outside them).
PHASES = ('schedule', 'make inputs', 'sampling inputs', 'to device', 'model (stubbed)', 'logits', 'sample',
          'update / settle', 'deliver', 'commit', 'release', 'stats')


class PhaseTimer:
    """Wraps callables so that each call's wall time adds to its phase, per step (`step` wraps `Engine.step`).
    A wrapped call inside another one counts in the outer one's phase only."""

    def __init__(self):
        self.on = False
        self.depth = 0
        self.current: collections.Counter = collections.Counter()
        self.steps: list[tuple[str, dict[str, float]]] = []  # (step kind, phase -> seconds incl. 'step (wall)')
        self.calls: collections.Counter = collections.Counter()

    def wrap(self, owner, name: str, phase: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            if not self.on or self.depth:
                return original(*args, **kwargs)
            self.calls[phase] += 1
            self.depth += 1
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.current[phase] += time.perf_counter() - t
                self.depth -= 1
        setattr(owner, name, timed)

    def step(self, engine: Engine) -> None:
        """One timed `engine.step()`, classified by the forward it scheduled (`Engine._batch`)."""
        self.current = collections.Counter()
        self.on = True
        t = time.perf_counter()
        try:
            engine.step()
        finally:
            self.on = False
        wall = time.perf_counter() - t
        batch = engine.stats_snapshot.batch
        kind = 'idle' if batch.num_seqs == 0 else 'decode' if batch.is_pure_decode else 'prefill'
        self.current['other'] = wall - sum(self.current.values())
        self.current['step (wall)'] = wall
        self.steps.append((kind, dict(self.current)))

    def mean_ms(self, kinds: tuple[str, ...]) -> dict[str, float]:
        rows = [phases for kind, phases in self.steps if kind in kinds]
        names = [*PHASES, 'other', 'step (wall)']
        return {name: sum(r.get(name, 0.0) for r in rows) / max(len(rows), 1) * 1e3 for name in names}


def build_engine(path: str, batch: int, async_scheduling: bool, prefix_caching: bool = False,
                 num_blocks: int | None = None, max_prefill: int = 8192, session_len: int = 4096
                 ) -> tuple[Engine, PhaseTimer]:
    """An engine whose model forward returns zeros at once, and a timer wrapped around its calls."""
    engine = Engine(path, PytorchEngineConfig(
        device_type='cpu', dtype='float32', block_size=64, num_gpu_blocks=num_blocks or 4 * batch + 16,
        max_batch_size=batch, max_prefill_token_num=max_prefill, session_len=session_len,
        async_scheduling=async_scheduling, enable_prefix_caching=prefix_caching))
    hidden = engine.model_config.hidden_size
    engine.agent.model.forward = lambda ctx: torch.zeros(ctx.inputs.input_ids.numel(), hidden)
    timer = PhaseTimer()
    sched, maker, agent = engine.scheduler, engine.inputs_maker, engine.agent
    for owner, name, phase in ((sched, 'schedule', 'schedule'), (maker, 'make', 'make inputs'),
                               (maker, 'make_cache_inputs', 'make inputs'),
                               (engine_step_module, 'make_sampling_inputs', 'sampling inputs'),
                               (agent.streams, 'to_device', 'to device'), (agent, '_upload', 'to device'),
                               (agent, 'run_model', 'model (stubbed)'),
                               (agent.model, 'compute_logits', 'logits'), (agent, '_sample', 'sample'),
                               (sched, 'update', 'update / settle'), (sched, 'settle', 'update / settle'),
                               (engine, '_sampled_rows', 'update / settle'),
                               (engine, '_update_output', 'deliver'), (engine, '_deliver_all', 'deliver'),
                               (sched, 'commit', 'commit'), (sched, 'release', 'release'),
                               (engine, '_make_stats', 'stats'), (engine, '_publish', 'stats')):
        timer.wrap(owner, name, phase)
    return engine, timer


def measure_decode(path: str, batch: int, steps: int, async_scheduling: bool) -> tuple[dict[str, float], int]:
    """Mean ms per phase of `steps` decode steps at `batch`, and the number of steps timed."""
    engine, timer = build_engine(path, batch, async_scheduling)
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(batch)
    # a stop id as served requests carry (eos), one the stubbed model never samples (its logits are all equal)
    params = SamplingParams(max_new_tokens=steps + 8, stop_token_ids=(vocab - 1,))
    for _ in range(batch):
        engine.add_request(torch.randint(0, vocab, (64,), generator=g).tolist(), params, callback=lambda out: None)
    for _ in range(4):  # prefill and a few decode steps
        engine.step()
    for _ in range(steps):
        timer.step(engine)
    engine.run_until_idle()
    engine.check_integrity()
    return timer.mean_ms(('decode',)), sum(kind == 'decode' for kind, _ in timer.steps)


def mix_workload(args: argparse.Namespace, vocab: int) -> list[tuple[int, list[int], int]]:
    """(arrival step, prompt, output tokens) per request: Poisson arrivals at `mix_rate` per step, lengths uniform
    in their ranges; a share `mix_shared` resends a non-block-aligned prefix of an earlier prompt plus new tokens."""
    rng = random.Random(0)
    out, step = [], 0.0
    for _ in range(args.mix_requests):
        n = rng.randint(*args.mix_prompt_len)
        prompt = [rng.randrange(vocab) for _ in range(n)]
        if out and rng.random() < args.mix_shared:
            base = rng.choice(out)[1]
            keep = min(len(base), n) - rng.randint(1, 63)
            prompt[:max(keep, 0)] = base[:max(keep, 0)]
        out.append((int(step), prompt, rng.randint(*args.mix_output_len)))
        step += rng.expovariate(args.mix_rate)
    return out


def measure_mix(path: str, args: argparse.Namespace) -> tuple[dict[str, dict[str, float]], dict]:
    """Every step of the mix until it drains; mean ms per phase over prefill-carrying steps, pure decode steps and
    all steps, plus counts (steps by kind, requests finished, tokens generated)."""
    engine, timer = build_engine(path, args.mix_batch, args.async_scheduling, prefix_caching=True,
                                 num_blocks=args.mix_blocks, session_len=4096)
    froze = freeze_heap() if args.gc_freeze else False  # where `AsyncEngine` freezes: its engine built
    frozen, passes = gc.get_freeze_count(), GCPasses()
    try:
        rows, counts = _run_mix(engine, timer, args, passes)
        return rows, dict(counts, frozen_objects=frozen)
    finally:
        passes.close()
        release_heap(froze)


class GCPasses:
    """The collector's passes from now until `close()`: (generation, pause seconds) each."""

    def __init__(self):
        self.passes: list[tuple[int, float]] = []
        self._began = 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if phase == 'start':
            self._began = time.perf_counter()
        else:
            self.passes.append((info['generation'], time.perf_counter() - self._began))

    def close(self) -> None:
        gc.callbacks.remove(self._on)

    def summary(self) -> dict[int, tuple[int, float, float]]:
        """generation -> (passes, longest ms, total ms)."""
        out = {}
        for gen in range(3):
            pauses = [s for g, s in self.passes if g == gen]
            out[gen] = (len(pauses), max(pauses, default=0.0) * 1e3, sum(pauses) * 1e3)
        return out


def _run_mix(engine: Engine, timer: PhaseTimer, args: argparse.Namespace, passes: GCPasses
             ) -> tuple[dict[str, dict[str, float]], dict]:
    vocab = engine.model_config.vocab_size
    workload = mix_workload(args, vocab - 1)  # prompts without the stop id
    generated: collections.Counter = collections.Counter()
    finished, cached = [], {}

    def callback(out) -> None:
        generated[out.seq_id] += len(out.new_token_ids)
        cached[out.seq_id] = out.num_cached
        if out.finished:
            finished.append((out.seq_id, out.error))

    step, pending = 0, collections.deque(workload)
    while pending or engine.has_work:
        if not engine.has_work and pending:
            step = max(step, pending[0][0])  # nothing runs: jump to the next arrival
        while pending and pending[0][0] <= step:
            _, prompt, new = pending.popleft()
            engine.add_request(prompt, SamplingParams(max_new_tokens=new, stop_token_ids=(vocab - 1,)),
                               callback=callback)
        timer.step(engine)
        engine.check_integrity()
        step += 1
    rows = {'prefill steps': timer.mean_ms(('prefill',)), 'decode steps': timer.mean_ms(('decode',)),
            'all steps': timer.mean_ms(('prefill', 'decode', 'idle'))}
    kinds = collections.Counter(kind for kind, _ in timer.steps)
    counts = dict(steps=len(timer.steps), steps_by_kind=dict(kinds), finished=len(finished),
                  errors=[e for _, e in finished if e], generated=sum(generated.values()),
                  expected_generated=sum(new for _, _, new in workload), calls=dict(timer.calls),
                  cached_tokens=sum(cached.values()), gc=passes.summary(),
                  max_step_ms=max(phases['step (wall)'] for _, phases in timer.steps) * 1e3)
    return rows, counts


def print_table(title: str, rows: dict) -> None:
    print(f'\n{title}')
    print(f'{"phase":<18}' + ''.join(f'{str(k):>15}' for k in rows))
    for phase in [*PHASES, 'other', 'step (wall)']:
        print(f'{phase:<18}' + ''.join(f'{r.get(phase, 0.0):>15.3f}' for r in rows.values()))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--batches', type=int, nargs='*', default=[1, 32, 128])
    parser.add_argument('--steps', type=int, default=50)
    parser.add_argument('--arch', default='qwen3_5')
    parser.add_argument('--async-modes', type=int, nargs='+', default=[0, 1], help='async scheduling off (0) / on (1)')
    parser.add_argument('--mix-requests', type=int, default=0, help='requests of the continuous-batching mix (0: off)')
    parser.add_argument('--mix-rate', type=float, default=0.25, help='arrivals per step')
    parser.add_argument('--mix-prompt-len', type=int, nargs=2, default=[256, 3840])
    parser.add_argument('--mix-output-len', type=int, nargs=2, default=[32, 256])
    parser.add_argument('--mix-shared', type=float, default=0.25)
    parser.add_argument('--mix-batch', type=int, default=128)
    parser.add_argument('--mix-blocks', type=int, default=4096)
    parser.add_argument('--async-scheduling', action=argparse.BooleanOptionalAction, default=False,
                        help='async scheduling in the mix')
    parser.add_argument('--gc-freeze', action=argparse.BooleanOptionalAction, default=True,
                        help='freeze the start-up heap before the mix, as the server does (engine/gc_freeze.py)')
    parser.add_argument('--repeat', type=int, default=1,
                        help='measure each row this many times and keep the fastest (a shared machine is noisy)')
    return parser.parse_args(argv)


def fastest(measure, repeat: int):
    """The result of `measure()` (mean ms per phase first) with the lowest step wall time over `repeat` calls."""
    return min((measure() for _ in range(max(repeat, 1))), key=lambda result: result[0]['step (wall)'])


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(1)
    results: dict = {'decode': {}, 'mix': None}
    with tempfile.TemporaryDirectory() as folder:
        path = save_tiny_model(folder, arch=args.arch)
        for mode in args.async_modes if args.batches else []:
            rows = {b: fastest(lambda b=b, m=bool(mode): measure_decode(path, b, args.steps, m), args.repeat)
                    for b in args.batches}
            results['decode'][bool(mode)] = rows
            print_table(f'async_scheduling={bool(mode)} ({args.arch}, ms per decode step, model stubbed)',
                        {f'batch {b}': r for b, (r, _) in rows.items()})
        if args.mix_requests:
            runs = [measure_mix(path, args) for _ in range(max(args.repeat, 1))]
            rows = {kind: min((r[kind] for r, _ in runs), key=lambda phases: phases['step (wall)'])
                    for kind in runs[0][0]}
            counts = runs[0][1]
            results['mix'] = (rows, counts)
            print_table(f'continuous-batching mix ({args.mix_requests} requests, prefix caching on, async '
                        f'scheduling {"on" if args.async_scheduling else "off"}; ms per step, model stubbed)', rows)
            print(f'steps {counts["steps"]} {counts["steps_by_kind"]}, finished {counts["finished"]}, '
                  f'tokens generated {counts["generated"]}, prompt tokens from the cache {counts["cached_tokens"]}')
            passes = ', '.join(f'gen{gen} {n} ({longest:.2f} / {total:.1f})'
                               for gen, (n, longest, total) in counts['gc'].items())
            print(f'start-up heap frozen: {args.gc_freeze}; longest step {counts["max_step_ms"]:.2f} ms; collector '
                  f'passes during the steps (count, longest / total ms): {passes}')
    return results


if __name__ == '__main__':
    main()
