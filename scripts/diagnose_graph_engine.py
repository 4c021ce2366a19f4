"""CUDA-graph replay vs eager mode in the engine, under variants of the graph machinery (a diagnostic).

Written for a fault that looked like hybrid decode graphs replaying logits ~3-4 off from eager mode (bf16 and
float32) while `scripts/diagnose_graph_ops.py` found the model captured alone replaying exactly. The `bisect`
variant below showed every replayed module output equal to eager; the fault was in the logits-collecting path the
tests use: `Engine._forward_collecting` copied the logits to the host on the default stream, which does not wait
for the forward stream, so after a graph replay (queued in one go) it read stale logits. Fixed in
`ModelAgent.forward_logits` (the copy is queued on the forward stream); regression test
`tests/engine/test_device_streams.py::test_collected_logits_wait_for_the_forward_stream`.

The script runs one greedy workload through engines that differ in one thing each and prints every variant's
largest logit error against eager mode (and where its tokens first part from it):

- `graphs`: the engine as shipped (decode graphs of every size captured up front on all-padding inputs, largest
  first, one shared memory pool, on the forward stream);
- `lazy`: no up-front capture; each decode size is captured on first use, right after its real eager step;
- `own-pool`: up-front capture, but every graph gets its own memory pool;
- `smallest-first`: up-front capture, smallest size first;
- `side-stream`: up-front capture on a side stream (as `torch.cuda.graph` does by default), replay on the forward
  stream;
- `static-eager`: no capture at all; decode batches run eagerly through the padded static buffers;
- `bisect`: lazy capture; each of the first two replays is compared module by module (forward hooks) with an eager
  run through the same static buffers from the same caches;
- `replay-twice`: replay each graph twice per step after a capture-time replay of garbage-free inputs (to see
  whether a graph's first replay differs from later ones).

    python3 scripts/diagnose_graph_engine.py [--arch qwen3_next] [--dtype bfloat16|float32]   # on the GPU
"""
from __future__ import annotations

import argparse
import contextlib
import tempfile
from unittest.mock import patch

import torch

from lmdeploy.demo_model import save_tiny_model
from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine import cuda_graph
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.messages import SamplingParams


def generate(engine: Engine, prompts: list[list[int]], max_new_tokens: int):
    outs: dict[int, list[int]] = {}
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=max_new_tokens), collect_logits=True,
                              callback=lambda o: outs.setdefault(o.seq_id, []).extend(o.new_token_ids))
           for p in prompts]
    while engine.has_work:
        engine.step()
    return [(outs[i], engine.pop_collected_logits(i).float().cpu()) for i in ids]


def variant(name: str):
    """A context manager that applies the variant's patch to `CUDAGraphRunner`."""
    runner_cls = cuda_graph.CUDAGraphRunner
    stack = contextlib.ExitStack()
    if name == 'lazy':
        stack.enter_context(patch.object(runner_cls, 'capture_all', lambda self: None))
    elif name == 'own-pool':
        capture = runner_cls._capture

        def own_pool(self, key, static_inputs):
            self.pool = None
            capture(self, key, static_inputs)
        stack.enter_context(patch.object(runner_cls, '_capture', own_pool))
    elif name == 'smallest-first':
        def smallest_first(self):
            for size in self.sizes:
                key = cuda_graph.GraphKey(size, size, True)
                self._fill(None, key)
                static_inputs = self.static.view(key)
                self.model(self.make_context(static_inputs))
                self._capture(key, static_inputs)
        stack.enter_context(patch.object(runner_cls, 'capture_all', smallest_first))
    elif name == 'side-stream':
        def side_stream(self, key, static_inputs):
            graph = torch.cuda.CUDAGraph()
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.model(self.make_context(static_inputs))
            torch.cuda.synchronize()
            self.graphs[key] = (graph, out)
        stack.enter_context(patch.object(runner_cls, '_capture', side_stream))
    elif name == 'replay-twice':
        run = runner_cls.run

        def twice(self, inputs, key=None):
            key = key or self.key_of(inputs)
            entry = self.graphs.get(key)
            if entry is not None:
                pool = [dict((n, v.clone()) for n, v in s.items()) for s in self.make_context(inputs).state_caches]
                self._fill(inputs, key)
                entry[0].replay()
                for views, saved in zip(self.make_context(inputs).state_caches, pool):
                    for n, v in views.items():
                        v.copy_(saved[n])
            return run(self, inputs, key)
        stack.enter_context(patch.object(runner_cls, 'run', twice))
    elif name == 'static-eager':
        def static_eager(self, inputs, key=None):
            key = key or self.key_of(inputs)
            self._fill(inputs, key)
            self.num_replays += 1
            return self.model(self.make_context(self.static.view(key)))[:inputs.input_ids.numel()]
        stack.enter_context(patch.object(runner_cls, 'capture_all', lambda self: None))
        stack.enter_context(patch.object(runner_cls, 'run', static_eager))
    elif name == 'bisect':
        stack.enter_context(patch.object(runner_cls, 'capture_all', lambda self: None))
        stack.enter_context(patch.object(runner_cls, 'run', _bisect_run(runner_cls.run)))
    elif name != 'graphs':
        raise ValueError(name)
    return stack


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return next((o for o in out if isinstance(o, torch.Tensor)), None)
    return None


def _bisect_run(run):
    """Graphs captured lazily; at each replay, snapshot the caches, replay, restore, run eagerly through the same
    static buffers, and print the modules whose outputs differ (hooks copy every module output into persistent
    buffers, so the copies are part of the captured graph too)."""
    state = dict(hooked=False, buffers={}, reports=0)

    def hook(name):
        def fn(_module, _inputs, output):
            t = _first_tensor(output)
            if t is None:
                return
            key = (name, tuple(t.shape), t.dtype)  # prefills (other shapes) keep their own buffers
            buf = state['buffers'].get(key)
            if buf is None:
                if torch.cuda.is_current_stream_capturing():
                    return
                buf = state['buffers'][key] = torch.empty_like(t)
            buf.copy_(t)
        return fn

    def bisect_run(self, inputs, key=None):
        key = key or self.key_of(inputs)
        if not state['hooked']:
            for name, module in self.model.named_modules():
                if name.count('.') <= 4 and name:
                    module.register_forward_hook(hook(name))
            state['hooked'] = True
        entry = self.graphs.get(key)
        if entry is None or state['reports'] >= 2:
            return run(self, inputs, key)
        ctx = self.make_context(inputs)
        pools = [v.clone() for layer in ctx.state_caches for v in layer.values()]
        kv = [t.clone() for pair in ctx.kv_caches for t in pair]
        self._fill(inputs, key)
        entry[0].replay()
        got = {n: b.clone() for n, b in state['buffers'].items()}
        got_out = entry[1].clone()
        for view, saved in zip([v for layer in ctx.state_caches for v in layer.values()], pools):
            view.copy_(saved)
        for view, saved in zip([t for pair in ctx.kv_caches for t in pair], kv):
            view.copy_(saved)
        out = self.model(self.make_context(self.static.view(key)))
        diffs = [(n[0], (got[n].float() - b.float()).abs().max().item())
                 for n, b in state['buffers'].items() if n in got]
        bad = [(n, d) for n, d in diffs if d > 1e-3]
        err = (got_out.float() - out.float()).abs().max().item()
        print(f'  bisect replay {state["reports"]} {key}: output diff {err:.3g}; {len(bad)} of {len(diffs)} module '
              f'outputs differ; first ones:')
        for n, d in bad[:12]:
            print(f'    {n}: {d:.3g}')
        state['reports'] += 1
        return out[:inputs.input_ids.numel()]
    return bisect_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--arch', default='qwen3_next')
    parser.add_argument('--dtype', default='bfloat16')
    parser.add_argument('--new-tokens', type=int, default=12)
    parser.add_argument('--cpu', action='store_true', help='a dry run of the script (no graphs on the CPU)')
    parser.add_argument('--variants',
                        default='graphs,static-eager,lazy,own-pool,smallest-first,side-stream,replay-twice')
    args = parser.parse_args()
    torch.manual_seed(0)
    path = save_tiny_model(tempfile.mkdtemp(), arch=args.arch)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (3, 17, 40)]
    common = dict(device_type='cpu' if args.cpu else 'cuda', dtype=args.dtype, block_size=16, kernel_block_size=8,
                  num_gpu_blocks=128, max_batch_size=4)
    ref = generate(Engine(path, PytorchEngineConfig(eager_mode=True, **common)), prompts, args.new_tokens)
    again = generate(Engine(path, PytorchEngineConfig(eager_mode=True, **common)), prompts, args.new_tokens)
    err = max((a[1] - b[1]).abs().max().item() for a, b in zip(again, ref))
    print(f'[{args.arch} {args.dtype}] eager vs eager (run-to-run noise): max logit diff {err:.3g}')
    for name in args.variants.split(','):
        try:
            with variant(name):
                engine = Engine(path, PytorchEngineConfig(**common))
                got = generate(engine, prompts, args.new_tokens)
        except Exception as exc:  # report and go on with the next variant
            print(f'[{args.arch} {args.dtype}] {name:15s} FAILED: {type(exc).__name__}: {exc}')
            continue
        parts, errs = [], []
        for (tokens, logits), (ref_tokens, ref_logits) in zip(got, ref):
            same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens))
            rows = logits.shape[0] - len(tokens) + same + 1
            prompt_rows = logits.shape[0] - len(tokens) + 1
            errs.append(((logits[:rows] - ref_logits[:rows]).abs().max().item(),
                         (logits[:prompt_rows] - ref_logits[:prompt_rows]).abs().max().item()))
            parts.append(same)
        replays = engine.agent.graph_runner.num_replays if engine.agent.graph_runner is not None else 0
        print(f'[{args.arch} {args.dtype}] {name:15s} replays {replays:3d}; max logit diff up to the '
              f'parting {max(e[0] for e in errs):.3g} (prompt rows: {max(e[1] for e in errs):.3g}); '
              f'tokens part at {parts}')


if __name__ == '__main__':
    main()
