"""Decode tokens/s of the engine with and without MTP speculative decoding, at batch 1 and 16, on a real-depth
Qwen3.5 shape (`--shape`: 0.8B, 24 layers, hidden 1024, vocab 248320; or 9B, transformers' default config, 32
layers, hidden 4096) with dummy weights.

Modes, per batch size (B requests of `--context` random prompt tokens, `--new-tokens` greedy tokens each), on CUDA
with the engine's default CUDA graphs (speculative engines replay graphs of the verify forward and the draft
head, `engine/spec_graphs.py`):
- `plain`: plain decoding;
- `mtp`: speculative decoding with the MTP head's own drafts (random weights: its acceptance means nothing, but
  it is reported: acceptance rate and mean accepted length from the engine's statistics);
- `forced_a`: forced acceptance, a = 1 .. K + 1 tokens emitted per verify step: a draft override replays the
  greedy continuation the `mtp` run emitted (the speculative engine's own stream; `mtp_equals_plain` is the share
  of its tokens equal to plain decoding's), wrong at draft a, so each verify accepts a - 1 drafts. The head still
  runs every step. The measured mean accepted length is printed beside the target a (bf16 near-ties can make a
  stream part from the recorded one, which then lowers acceptance).
- `--eager` adds `plain_eager` and `mtp_eager` / `forced_eager_{K+1}` (the same without graphs).
Decode tokens/s counts only the steps after every request got its first token (prefill excluded). The commit
printed is `LMDEPLOY_COMMIT` from the environment (else `git rev-parse`).

    python benchmark/bench_mtp_engine.py [--draft-tokens 3] [--batches 1 16] [--context 512] [--new-tokens 64]
    python benchmark/bench_mtp_engine.py --smoke        # tiny shape on the CPU (what CI runs)

Prints a table and, last, one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_mtp_decode import REAL_SHAPE, SMOKE_SHAPE, write_config  # noqa: E402

# transformers' default Qwen3_5TextConfig widths (Qwen3.5-9B: hidden 4096, 16 / 4 heads of 256, 16 / 32
# linear heads of 128, vocab 248320); write_config sets the depth and one MTP layer
NINE_B_SHAPE = dict(vocab_size=248320)

from lmdeploy import PytorchEngineConfig, SpeculativeConfig  # noqa: E402
from lmdeploy.pytorch.engine.engine import Engine  # noqa: E402
from lmdeploy.pytorch.engine.spec_chain import chain_graph_enabled  # noqa: E402
from lmdeploy.pytorch.messages import SamplingParams  # noqa: E402


def make_engine(path: str, device: str, dtype: str, batch: int, context: int, new_tokens: int, k: int,
                eager: bool) -> Engine:
    block = 64
    blocks = batch * (-(-(context + new_tokens + 4 * k + 8) // block)) + 8
    return Engine(path, PytorchEngineConfig(
        device_type=device, dtype=dtype, load_format='dummy', block_size=block, num_gpu_blocks=blocks,
        max_batch_size=batch, max_prefill_token_num=max(batch * context, 256), eager_mode=eager,
        speculative_config=SpeculativeConfig('mtp', k) if k else None))


def decode(engine: Engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]], dict]:
    """Decode tokens/s after the prefill, each request's tokens, and the speculative counters of the run."""
    tokens: dict[int, list[int]] = {}
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    ids = [engine.add_request(p, sampling, callback=lambda o: tokens.setdefault(o.seq_id, []).extend(
        o.new_token_ids)) for p in prompts]
    while not all(tokens.get(i) for i in ids):
        engine.step()
    before = dict(engine.stats)
    start_tokens = sum(len(tokens[i]) for i in ids)
    sync = torch.cuda.synchronize if engine.device.type == 'cuda' else (lambda: None)
    sync()
    t0 = time.perf_counter()
    while engine.has_work:
        engine.step()
    sync()
    seconds = time.perf_counter() - t0
    after = engine.stats
    spec = {key: after[key] - before.get(key, 0) for key in ('spec_verify_rows', 'spec_draft_tokens',
                                                             'spec_accepted_tokens') if key in after}
    emitted = sum(len(tokens[i]) for i in ids) - start_tokens
    return emitted / seconds, [tokens[i] for i in ids], spec


def _summary(spec: dict) -> dict:
    if not spec or not spec['spec_verify_rows']:
        return {}
    return dict(acceptance_rate=spec['spec_accepted_tokens'] / max(spec['spec_draft_tokens'], 1),
                mean_accepted_length=1 + spec['spec_accepted_tokens'] / spec['spec_verify_rows'])


def replay(continuations: dict[tuple, list[int]], prompt_len: int, k: int, accept: int):
    """A draft override proposing the recorded continuation, wrong at draft `accept` (accept = K: all right)."""
    def override(seq, _):
        cont = continuations[tuple(seq.token_ids[:prompt_len])] + [0] * (2 * k)
        start = seq.num_tokens - prompt_len
        drafts = cont[start:start + k]
        if accept < k:
            drafts[accept] = (drafts[accept] + 1) % 1000
        return drafts
    return override


def bench_batch(path, device, dtype, batch, context, new_tokens, k, vocab, eager: bool) -> dict:
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, vocab, (context,), generator=gen).tolist() for _ in range(batch)]
    row = {'batch': batch}
    graphs = device == 'cuda'
    plain = make_engine(path, device, dtype, batch, context, new_tokens, 0, eager=not graphs)
    row['plain'], plain_outs, _ = decode(plain, prompts, new_tokens)
    del plain
    spec = make_engine(path, device, dtype, batch, context, new_tokens, k, eager=not graphs)
    row['mtp'], outs, stats = decode(spec, prompts, new_tokens)
    row['mtp_stats'] = _summary(stats)
    # the forced runs replay this engine's own greedy stream (bf16 near-ties of dummy weights can part plain and
    # speculative decoding's kernels); how much of it equals plain decoding's is reported
    row['mtp_equals_plain'] = sum(a == b for o, p in zip(outs, plain_outs) for a, b in zip(o, p)) / \
        max(1, sum(len(o) for o in outs))
    continuations = {tuple(p): o for p, o in zip(prompts, outs)}
    for a in range(1, k + 2):
        spec.speculative.set_draft_override(replay(continuations, context, k, a - 1))
        row[f'forced_{a}'], _, stats = decode(spec, prompts, new_tokens)
        row[f'forced_{a}_stats'] = _summary(stats)
    if graphs:
        agent = spec.agent
        row['verify_graph_replays'] = agent.verify_graphs.num_replays
        row['head_graph_replays'] = agent.head_graphs.runner.num_replays
        # the greedy chain in one graph (the default; 0 with LMDEPLOY_SPEC_CHAIN_GRAPH=0): one replay per drafting step
        row['chain_graph_replays'] = agent.chain_graphs.num_replays if agent.chain_graphs is not None else 0
    del spec
    if eager and graphs:
        plain = make_engine(path, device, dtype, batch, context, new_tokens, 0, eager=True)
        row['plain_eager'], _, _ = decode(plain, prompts, new_tokens)
        del plain
        spec = make_engine(path, device, dtype, batch, context, new_tokens, k, eager=True)
        row['mtp_eager'], _, stats = decode(spec, prompts, new_tokens)
        row['mtp_eager_stats'] = _summary(stats)
        spec.speculative.set_draft_override(replay({tuple(p): o for p, o in zip(prompts, plain_outs)}, context, k, k))
        row[f'forced_eager_{k + 1}'], _, stats = decode(spec, prompts, new_tokens)
        row[f'forced_eager_{k + 1}_stats'] = _summary(stats)
        del spec
    return row


def commit() -> str:
    """`LMDEPLOY_COMMIT` (the device checkout's .git is stale), else this checkout's HEAD."""
    if os.environ.get('LMDEPLOY_COMMIT'):
        return os.environ['LMDEPLOY_COMMIT']
    try:
        return subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout.strip() or 'unknown'
    except (OSError, subprocess.SubprocessError):
        return 'unknown'


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--shape', choices=['qwen3.5-0.8b', 'qwen3.5-9b'], default='qwen3.5-0.8b',
                        help="0.8B: the widths above; 9B: transformers' default Qwen3_5TextConfig (hidden 4096)")
    parser.add_argument('--layers', type=int, default=None, help='default: the shape\'s depth (24 / 32)')
    parser.add_argument('--draft-tokens', type=int, default=3)
    parser.add_argument('--batches', type=int, nargs='+', default=[1, 16])
    parser.add_argument('--context', type=int, default=512)
    parser.add_argument('--new-tokens', type=int, default=64)
    parser.add_argument('--smoke', action='store_true', help='tiny shape on the CPU, float32')
    parser.add_argument('--eager', action='store_true', help='also plain and speculative decoding without graphs')
    args = parser.parse_args(argv)
    smoke = args.smoke or not torch.cuda.is_available()
    device, dtype = ('cpu', 'float32') if smoke else ('cuda', 'bfloat16')
    nine_b = args.shape == 'qwen3.5-9b'
    layers, context, new_tokens = (4, 24, 12) if smoke else (args.layers or (32 if nine_b else 24), args.context,
                                                             args.new_tokens)
    shape = SMOKE_SHAPE if smoke else NINE_B_SHAPE if nine_b else REAL_SHAPE
    k = args.draft_tokens
    began = time.perf_counter()
    print(f'bench_mtp_engine: commit={commit()} device={device} dtype={dtype} shape={"smoke" if smoke else args.shape} '
          f'layers={layers} K={k} LMDEPLOY_SPEC_CHAIN_GRAPH={int(chain_graph_enabled())}',
          flush=True)
    with tempfile.TemporaryDirectory() as path:
        write_config(path, layers, shape)
        rows = [bench_batch(path, device, dtype, b, context, new_tokens, k, shape['vocab_size'], args.eager)
                for b in args.batches]
    modes = ['plain', 'mtp'] + [f'forced_{a}' for a in range(1, k + 2)]
    if args.eager and device == 'cuda':
        modes += ['plain_eager', 'mtp_eager', f'forced_eager_{k + 1}']
    print('decode tokens/s (prefill excluded)' + (', CUDA graphs' if device == 'cuda' else ', eager') +
          '; forced_a: a tokens emitted per verify step (measured mean accepted length in brackets)')
    print(f'{"batch":>5} ' + ' '.join(f'{m:>16}' for m in modes))
    for r in rows:
        cells = []
        for m in modes:
            length = r.get(f'{m}_stats', {}).get('mean_accepted_length')
            cells.append(f'{r[m]:>9.1f}' + (f' [{length:.2f}]' if length is not None else ' ' * 7))
        print(f'{r["batch"]:>5} ' + ' '.join(f'{c:>16}' for c in cells))
    result = dict(commit=commit(), layers=layers, context=context, new_tokens=new_tokens, draft_tokens=k,
                  device=device, dtype=dtype, rows=rows, seconds=round(time.perf_counter() - began, 1))
    print(json.dumps(result))
    return result


if __name__ == '__main__':
    main()
