"""Host cost of one eager forward per decoder layer, and kernel launches per layer, on the cuda backend.

The eager forward of a real-depth model is host-bound when the host takes longer to queue a layer's kernels than the
device takes to run them. This script times, for each eager forward the engine runs, the host time of the model's
forward call (queueing only: no synchronisation inside, see tests/engine/test_forward_no_sync.py) and the device time
(CUDA events), and counts the kernels one forward launches (torch.profiler, CUDA activity). Shapes: Qwen3-Next's
hybrid layers (3 gated DeltaNet : 1 attention, hidden 2048) with 64 experts top-10 ("moe") or a dense MLP ("dense"),
random bf16 weights, 12 layers, a 1024-token vocabulary (the lm_head is not what is measured).

    python3 benchmark/bench_host_per_layer.py                 # every shape, fast launch and fused ops on
    python3 benchmark/bench_host_per_layer.py --compare       # before / after: each toggle in a subprocess

`--compare` runs LMDEPLOY_FAST_LAUNCH / LMDEPLOY_FUSED_OPS = 0/0 (the plain Triton launcher, unfused ops), 1/0 and
1/1 and prints one table.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_shapes import QWEN3_NEXT_3B, SMALL_VOCAB, SMOKE_HYBRID  # noqa: E402 - beside this script

BASE_CONFIG = dict(QWEN3_NEXT_3B, **SMALL_VOCAB)
SHAPES = {'moe': BASE_CONFIG, 'dense': dict(BASE_CONFIG, mlp_only_layers=list(range(12)))}
SMOKE = SMOKE_HYBRID  # --smoke (CPU, float32, tiny widths): checks the script itself, its numbers mean nothing
TOGGLES = [('0', '0'), ('1', '0'), ('1', '1')]  # (LMDEPLOY_FAST_LAUNCH, LMDEPLOY_FUSED_OPS)


def build(model_dir: str, cfg: dict, device: str) -> None:
    import transformers as tf
    marker = os.path.join(model_dir, 'bench_config.json')
    if os.path.isfile(marker) and json.load(open(marker)) == cfg:
        return
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**cfg)).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    model.generation_config = tf.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=1)
    shutil.rmtree(model_dir, ignore_errors=True)
    model.save_pretrained(model_dir)
    json.dump(cfg, open(marker, 'w'))
    del model
    torch.cuda.empty_cache()


class ForwardTimer:
    """Wraps the model's forward: host ms of each call (no sync) and its device ms (CUDA events)."""

    def __init__(self, model, on_cuda: bool):
        self.model, self.forward, self.on_cuda = model, model.forward, on_cuda
        self.records: list[tuple[float, torch.cuda.Event, torch.cuda.Event]] = []
        model.forward = self

    def __call__(self, *args, **kwargs):
        start = end = None
        if self.on_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t = time.perf_counter()
        out = self.forward(*args, **kwargs)
        host = (time.perf_counter() - t) * 1e3
        if end is not None:
            end.record()
        self.records.append((host, start, end))
        return out

    def take(self) -> tuple[float, float]:
        """(median host ms, median device ms) of the forwards since the last call."""
        if self.on_cuda:
            torch.cuda.synchronize()
        host = [h for h, _, _ in self.records]
        device = [s.elapsed_time(e) if s is not None else 0.0 for _, s, e in self.records]
        self.records = []
        return statistics.median(host), statistics.median(device)


def run(engine, prompts: list[list[int]], new_tokens: int) -> None:
    from lmdeploy.pytorch.messages import SamplingParams
    params = SamplingParams(max_new_tokens=new_tokens, min_new_tokens=new_tokens, stop_token_ids=())
    for p in prompts:
        engine.add_request(p, params)
    while engine.has_work:
        engine.step()


def kernels_per_step(engine, prompt: list[int]) -> int:
    """Kernels one eager decode step launches (torch.profiler's CUDA kernel events; the model forward plus the
    step's few embedding / logits / sampling kernels)."""
    from lmdeploy.pytorch.messages import SamplingParams
    engine.add_request(prompt, SamplingParams(max_new_tokens=4, min_new_tokens=4, stop_token_ids=()))
    engine.step()  # prefill
    engine.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    while engine.has_work:
        engine.step()
    return sum(1 for evt in prof.events() if evt.device_type == torch.autograd.DeviceType.CUDA
               and not evt.name.startswith(('Memcpy', 'Memset')))


def measure(shape: str, model_dir: str, smoke: bool = False) -> dict:
    from lmdeploy.messages import PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine
    cfg = dict(SHAPES[shape], **SMOKE) if smoke else SHAPES[shape]
    device = 'cpu' if smoke else 'cuda'
    build(model_dir, cfg, device)
    engine = Engine(model_dir, PytorchEngineConfig(device_type=device, dtype='float32' if smoke else 'bfloat16',
                                                   eager_mode=True, cache_max_entry_count=0.2, max_batch_size=64,
                                                   session_len=8192))
    g = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(3, cfg['vocab_size'], (n,), generator=g).tolist()

    run(engine, [prompt(64)], 4)  # warm-up: compile every kernel specialization used below
    run(engine, [prompt(512)], 2)
    run(engine, [prompt(64) for _ in range(32)], 2)
    timer = ForwardTimer(engine.agent.model, not smoke)
    layers = cfg['num_hidden_layers']
    row = {'shape': shape, 'layers': layers}
    run(engine, [prompt(64)], 33)
    timer.records = timer.records[1:]  # drop the prefill
    row['decode1_host'], row['decode1_dev'] = timer.take()
    run(engine, [prompt(64) for _ in range(32)], 17)
    timer.records = timer.records[1:]
    row['decode32_host'], row['decode32_dev'] = timer.take()
    for _ in range(5):
        run(engine, [prompt(1024)], 1)
    row['prefill1k_host'], row['prefill1k_dev'] = timer.take()
    engine.agent.model.forward = timer.forward
    row['kernels_decode'] = 0 if smoke else kernels_per_step(engine, prompt(64))
    return row


def print_rows(rows: list[dict]) -> None:
    print('| shape | fast launch | fused ops | decode b1 host ms/layer (device) | decode b32 host ms/layer (device) '
          '| 1K prefill host ms/layer (device) | kernels per decode step / layers |')
    print('|---|---|---|---:|---:|---:|---:|')
    for r in rows:
        n = r['layers']
        print(f"| {r['shape']} | {r.get('fast', '1')} | {r.get('fused', '1')} "
              f"| {r['decode1_host'] / n:.3f} ({r['decode1_dev'] / n:.3f}) "
              f"| {r['decode32_host'] / n:.3f} ({r['decode32_dev'] / n:.3f}) "
              f"| {r['prefill1k_host'] / n:.3f} ({r['prefill1k_dev'] / n:.3f}) | {r['kernels_decode'] / n:.1f} |",
              flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--shapes', nargs='+', default=list(SHAPES), choices=list(SHAPES))
    p.add_argument('--model-root', default='/tmp/bench_host_per_layer')
    p.add_argument('--compare', action='store_true', help='before/after table over the env toggles')
    p.add_argument('--json', action='store_true', help='print one JSON row per shape (used by --compare)')
    p.add_argument('--smoke', action='store_true', help='CPU, tiny widths: check the script only')
    args = p.parse_args()
    if args.compare:
        rows = []
        for fast, fused in TOGGLES:
            env = {**os.environ, 'LMDEPLOY_FAST_LAUNCH': fast, 'LMDEPLOY_FUSED_OPS': fused}
            cmd = [sys.executable, __file__, '--json', '--model-root', args.model_root, '--shapes', *args.shapes,
                   *(['--smoke'] if args.smoke else [])]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                print(f'toggles {fast}/{fused} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}', flush=True)
                continue
            new = [dict(json.loads(line), fast=fast, fused=fused) for line in proc.stdout.splitlines()
                   if line.startswith('{')]
            print_rows(new)  # as it comes, so a run cut by a timeout still shows its rows
            rows += new
        print('all rows:')
        print_rows(sorted(rows, key=lambda r: (r['shape'], r['fast'], r['fused'])))
        return
    rows = [measure(shape, os.path.join(args.model_root, shape), args.smoke) for shape in args.shapes]
    if args.json:
        for r in rows:
            print(json.dumps(r), flush=True)
    else:
        print_rows(rows)


if __name__ == '__main__':
    main()
