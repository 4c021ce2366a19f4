"""Where the host time of one decode step goes, with the model forward stubbed out (CPU).

A decode step on the GPU replays a CUDA graph; what the device cannot hide is the engine's own host work around it.
This bench isolates that work: the model's forward returns zeros of the right shape at once, so an engine step is
scheduling, input building, sampling inputs, the copies, sampling a tiny vocabulary, and the bookkeeping after it.
Each phase is timed by wrapping the engine's own calls (per step, mean over the timed steps), at several batch sizes,
with async scheduling off and on (on the CPU the device runs inline, so "on" only shows the reordering's cost).

    python benchmark/bench_decode_host.py [--batches 1 32 128] [--steps 50]
"""
from __future__ import annotations

import argparse
import collections
import tempfile
import time

import torch

from lmdeploy.demo_model import save_tiny_model
from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine import engine as engine_module
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.messages import SamplingParams


class PhaseTimer:
    """Wraps callables so that each call's wall time adds to its phase."""

    def __init__(self):
        self.totals: collections.Counter = collections.Counter()
        self.on = False

    def wrap(self, owner, name: str, phase: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            if not self.on:
                return original(*args, **kwargs)
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.totals[phase] += time.perf_counter() - t
        setattr(owner, name, timed)


def measure(path: str, batch: int, steps: int, async_scheduling: bool) -> dict[str, float]:
    engine = Engine(path, PytorchEngineConfig(
        device_type='cpu', dtype='float32', block_size=64, num_gpu_blocks=4 * batch + 16, max_batch_size=batch,
        max_prefill_token_num=8192, session_len=4096, async_scheduling=async_scheduling))
    hidden = engine.model_config.hidden_size
    engine.agent.model.forward = lambda ctx: torch.zeros(ctx.inputs.input_ids.numel(), hidden)
    timer = PhaseTimer()
    sched, maker, agent = engine.scheduler, engine.inputs_maker, engine.agent
    for owner, name, phase in ((sched, 'schedule', 'schedule'), (maker, 'make', 'make inputs'),
                               (maker, 'make_cache_inputs', 'make inputs'),
                               (engine_module, 'make_sampling_inputs', 'sampling inputs'),
                               (agent.streams, 'to_device', 'to device'), (agent, 'run_model', 'model (stubbed)'),
                               (agent, '_sample', 'sample'), (sched, 'update', 'update / settle'),
                               (sched, 'settle', 'update / settle'), (engine, '_deliver_all', 'deliver'),
                               (sched, 'commit', 'commit'), (sched, 'release', 'release'),
                               (engine, '_make_stats', 'stats'), (engine, '_publish', 'stats')):
        timer.wrap(owner, name, phase)
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_new_tokens=steps + 8, min_new_tokens=steps + 8)
    for _ in range(batch):
        engine.add_request(torch.randint(0, vocab, (64,), generator=g).tolist(), params, callback=lambda out: None)
    for _ in range(4):  # prefill and a few decode steps
        engine.step()
    timer.on = True
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - t
    timer.on = False
    engine.run_until_idle()
    out = {phase: total / steps * 1e3 for phase, total in timer.totals.items()}
    out['step (wall)'] = wall / steps * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--batches', type=int, nargs='+', default=[1, 32, 128])
    parser.add_argument('--steps', type=int, default=50)
    parser.add_argument('--arch', default='qwen3_5')
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        path = save_tiny_model(folder, arch=args.arch)
        for async_scheduling in (False, True):
            rows = {b: measure(path, b, args.steps, async_scheduling) for b in args.batches}
            phases = list(rows[args.batches[0]])
            print(f'\nasync_scheduling={async_scheduling} ({args.arch}, ms per decode step, model stubbed)')
            print(f'{"phase":<18}' + ''.join(f'{"batch " + str(b):>12}' for b in args.batches))
            for phase in phases:
                print(f'{phase:<18}' + ''.join(f'{rows[b].get(phase, 0.0):>12.3f}' for b in args.batches))


if __name__ == '__main__':
    main()
