"""The lmdeploy engine against Hugging Face transformers on a Qwen3-Next-shaped model with random bf16 weights.

The checkpoint (~3.5B parameters, 6.9 GB in bf16: 12 layers, 3 gated-DeltaNet : 1 full-attention, 64 experts,
top-10) is built once with transformers directly on the GPU and saved to `--model-dir` (reused when its config
matches). Prompts are random token ids; both systems see the same prompts (seeded); decoding is greedy with exactly
`--decode-new-tokens` tokens.

Measured in one process. The transformers model (built for the checkpoint, or loaded with AutoModelForCausalLM)
stays resident next to one engine at a time: the engine sizes its KV pool as `cache_max_entry_count=0.3` of the
memory left, which leaves room for transformers' activations. Measurements run in pairs (engine, then transformers,
same prompts), so a `--time-budget` or an outer timeout cuts whole comparisons, not one system. Order: phase 1 an
engine with prefix caching off (decode, cold TTFT); it is deleted and the CUDA cache emptied; phase 2 an engine with
prefix caching on (cold TTFT, cached-prefix TTFT). Rows:
  - cold TTFT of 1K / 4K / 16K-token prompts: engine with prefix caching off and on (target: on within 5% of off),
    transformers one forward (`use_cache=True`, `logits_to_keep=1`) + argmax;
  - TTFT of a 100-token suffix after a cached, non-block-aligned prefix of 924 / 3996 / 16284 tokens: the engine
    (prefix caching on) first runs the prefix (max_new_tokens=1), then prefix+suffix is timed; transformers runs the
    prefix with `use_cache=True` (untimed) and times only the suffix forward on that cache. Hybrid caches are
    mutated in place, so each repetition uses a fresh prefix run (target: engine >= 3x faster);
  - decode tokens/s at batch 1 / 16 / 64 with 512-token prompts and 128 new tokens: 'overall' = B*new / total
    time; 'decode' = tokens generated after every request's first token / the time after the last first token
    (engine: timestamped per token; transformers: B*(new-1) / (generate time - a separately timed prefill forward)).
    Targets: engine >= 10x transformers at batch 1, >= 5x at batch 64.

Each path is warmed up with a small prompt and, per size, one untimed repetition, so compilation and Triton
autotuning are excluded; timings are wall-clock with `torch.cuda.synchronize()` around them, median of `--reps`.
Every measurement runs in its own try/except: a failure is printed and reported as `n/a`, and the rest continue.
The markdown report is (re)written to `--out` after every measurement, so a timeout still leaves partial results.

    python benchmark/bench_vs_transformers.py [--out report.md] [--model-dir /tmp/qwen3next_bench]
    python benchmark/bench_vs_transformers.py --smoke      # tiny float32 model on the CPU: checks the logic only

Prints progress, a markdown table and, last, one JSON line.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_harness import (  # noqa: E402 - the shared helpers beside this script
    HF,
    collect_env,
    engine_run,
    engine_warmup,
    in_inference_mode,
    make_prompt,
    measure_cold,
    measure_suffix,
    median,
    seed_of,
)
from bench_harness import Bench as BenchBase  # noqa: E402
from bench_shapes import QWEN3_NEXT_3B, SMALL_VOCAB, SMOKE_HYBRID  # noqa: E402
from vs_transformers_report import build_rows, render_markdown  # noqa: E402

FULL_CONFIG = QWEN3_NEXT_3B
SMOKE_CONFIG = dict(FULL_CONFIG, **SMOKE_HYBRID, **SMALL_VOCAB, max_position_embeddings=4096, initializer_range=0.1)
# keys compared to decide whether an existing --model-dir can be reused
_REUSE_KEYS = ('vocab_size', 'hidden_size', 'num_hidden_layers', 'layer_types', 'num_attention_heads',
               'num_key_value_heads', 'head_dim', 'linear_num_key_heads', 'linear_num_value_heads',
               'linear_key_head_dim', 'linear_value_head_dim', 'num_experts', 'num_experts_per_tok',
               'moe_intermediate_size', 'shared_expert_intermediate_size')



class Bench(BenchBase):
    """The shared harness, reporting this script's table."""

    def render(self) -> str:
        return render_markdown(self)


# ----------------------------------------------------------------------------------------------------------------
# checkpoint
# ----------------------------------------------------------------------------------------------------------------
def _reusable(model_dir: str, cfg: dict) -> bool:
    path = os.path.join(model_dir, 'config.json')
    if not os.path.isfile(path) or not os.path.isfile(os.path.join(model_dir, 'generation_config.json')):
        return False
    if not any(f.endswith('.safetensors') for f in os.listdir(model_dir)):
        return False
    with open(path) as f:
        saved = json.load(f)
    return all(saved.get(k) == cfg[k] for k in _REUSE_KEYS)


def build_checkpoint(bench: Bench, cfg: dict, dtype: torch.dtype):
    """Build (random weights) and save the checkpoint; returns the transformers model, kept for the HF runs."""
    import transformers as tf
    model_dir = bench.args.model_dir
    config = tf.Qwen3NextConfig(**cfg)
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(bench.device):
            model = tf.Qwen3NextForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    model.eval()
    model.generation_config = tf.GenerationConfig(bos_token_id=cfg['bos_token_id'], eos_token_id=cfg['eos_token_id'],
                                                  pad_token_id=cfg['pad_token_id'])
    tmp = model_dir.rstrip('/') + f'.tmp{os.getpid()}'
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)  # transformers 5 always writes safetensors
    model.generation_config.save_pretrained(tmp)
    shutil.rmtree(model_dir, ignore_errors=True)
    os.rename(tmp, model_dir)
    return model


def load_hf_model(bench: Bench, dtype: torch.dtype):
    """AutoModelForCausalLM; `device_map` needs accelerate, so without it load on the CPU and move."""
    from transformers import AutoModelForCausalLM
    if importlib.util.find_spec('accelerate') is not None:
        model = AutoModelForCausalLM.from_pretrained(bench.args.model_dir, dtype=dtype, device_map=bench.device)
    else:
        model = AutoModelForCausalLM.from_pretrained(bench.args.model_dir, dtype=dtype).to(bench.device)
    return model.eval()


# ----------------------------------------------------------------------------------------------------------------
# engine
# ----------------------------------------------------------------------------------------------------------------

def build_engine(bench: Bench, prefix_caching: bool):
    from lmdeploy.messages import PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine
    a = bench.args
    extra = {}
    if a.prefill_state_interval is not None:
        extra['prefix_cache_prefill_state_interval'] = a.prefill_state_interval
    config = PytorchEngineConfig(
        device_type=bench.device, dtype=a.dtype, block_size=a.block_size, cache_max_entry_count=a.cache_max_entry_count,
        num_gpu_blocks=a.num_blocks, max_batch_size=a.max_batch_size, max_prefill_token_num=a.max_prefill_token_num,
        session_len=a.session_len, enable_prefix_caching=prefix_caching,
        **extra)
    t = time.perf_counter()
    engine = Engine(a.model_dir, config)
    bench.log(f'engine (prefix caching {"on" if prefix_caching else "off"}) built in {time.perf_counter() - t:.1f}s: '
              f'{engine.cache_config.num_blocks} KV blocks, session_len {engine.session_len}')
    return engine


def engine_decode(bench: Bench, engine, batch: int, vocab: int) -> dict:
    a = bench.args
    new = a.decode_new_tokens
    engine_run(bench, engine, [make_prompt(a.decode_prompt_len, seed_of('decode', batch, -1) * 1000 + i, vocab)
                               for i in range(batch)], min(4, new))  # warm-up at this batch size
    overall, decode, ttft = [], [], []
    tokens = []
    for rep in range(a.decode_reps):
        prompts = [make_prompt(a.decode_prompt_len, seed_of('decode', batch, rep) * 1000 + i, vocab)
                   for i in range(batch)]
        t0, recs = engine_run(bench, engine, prompts, new)
        bad = [len(r.times) for r in recs if len(r.times) != new]
        if bad:
            raise RuntimeError(f'{len(bad)} request(s) generated {bad[:4]} tokens instead of {new}')
        t_end = max(r.end for r in recs)
        t_last_first = max(r.first for r in recs)
        after = sum(1 for r in recs for t in r.times if t > t_last_first)
        overall.append(batch * new / (t_end - t0))
        decode.append(after / (t_end - t_last_first) if t_end > t_last_first else float('nan'))
        ttft.append((t_last_first - t0) * 1e3)
        if rep == 0:
            tokens = [r.first_token for r in recs]
    return {'decode_tok_s': median(decode), 'overall_tok_s': median(overall), 'last_ttft_ms': median(ttft),
            'first_tokens': tokens}


# ----------------------------------------------------------------------------------------------------------------
# transformers
# ----------------------------------------------------------------------------------------------------------------
def hf_decode(hf: HF, batch: int, vocab: int) -> dict:
    a = hf.bench.args
    new = a.decode_new_tokens

    def prompts(rep: int) -> torch.Tensor:
        return hf.ids([make_prompt(a.decode_prompt_len, seed_of('decode', batch, rep) * 1000 + i, vocab)
                       for i in range(batch)])

    def generate(ids: torch.Tensor, n: int) -> torch.Tensor:
        return hf.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=n, min_new_tokens=n)

    generate(prompts(-1), min(4, new))  # warm-up at this batch size
    hf.timed_forward(prompts(-1))
    overall, decode, prefill = [], [], []
    tokens = []
    for rep in range(a.decode_reps):
        ids = prompts(rep)
        p_ms, _ = hf.timed_forward(ids)
        hf.bench.sync()
        t0 = time.perf_counter()
        out = generate(ids, new)
        hf.bench.sync()
        total = time.perf_counter() - t0
        generated = out.shape[1] - ids.shape[1]
        if generated != new:
            raise RuntimeError(f'generate produced {generated} tokens instead of {new}')
        prefill.append(p_ms)
        overall.append(batch * new / total)
        decode_s = total - p_ms / 1e3
        decode.append(batch * (new - 1) / decode_s if decode_s > 0 else float('nan'))
        if rep == 0:
            tokens = out[:, ids.shape[1]].tolist()
        del out
    return {'decode_tok_s': median(decode), 'overall_tok_s': median(overall), 'prefill_ms': median(prefill),
            'first_tokens': tokens}


def prepare_hf(bench: Bench, model, dtype: torch.dtype, vocab: int) -> HF | None:
    """Load (unless just built) and warm up the transformers model; None (errors recorded) on failure."""
    a = bench.args
    keys = ([f'hf.decode.{b}' for b in a.decode_batches] + [f'hf.cold.{n}' for n in a.cold_sizes]
            + [f'hf.suffix.{n}' for n in a.prefix_sizes])
    try:
        if model is None:
            t = time.perf_counter()
            model = load_hf_model(bench, dtype)
            bench.log(f'transformers model loaded in {time.perf_counter() - t:.1f}s')
        hf = HF(bench, model)
        cfg = model.config
        bench.env['hf_attn_implementation'] = str(getattr(cfg, '_attn_implementation', '?'))
        bench.env['hf_experts_implementation'] = str(getattr(cfg, '_experts_implementation', '?'))
        bench.env['hf_cache_kwarg'] = hf.cache_kwarg
        bench.log(f'transformers: attn={bench.env["hf_attn_implementation"]}, '
                  f'experts={bench.env["hf_experts_implementation"]}, cache kwarg={hf.cache_kwarg}')
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        bench.fail_all(keys, 'transformers load', exc)
        return None
    t = time.perf_counter()
    try:
        with torch.inference_mode():
            hf.timed_forward(hf.ids([make_prompt(64, 7, vocab)]))
            hf.model.generate(input_ids=hf.ids([make_prompt(64, 7, vocab)]), do_sample=False, max_new_tokens=2,
                              min_new_tokens=2)
        bench.log(f'transformers warmed up in {time.perf_counter() - t:.1f}s')
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        bench.log(f'transformers warm-up failed: {exc} (measuring anyway)')
    return hf


def prepare_engine(bench: Bench, prefix_caching: bool, vocab: int):
    """Build and warm up an engine; None (errors recorded) on failure or when the time budget is spent."""
    a = bench.args
    tag = 'engine_pc_on' if prefix_caching else 'engine_pc_off'
    keys = [f'{tag}.cold.{n}' for n in a.cold_sizes]
    keys += ([f'{tag}.suffix.{n}' for n in a.prefix_sizes] if prefix_caching
             else [f'{tag}.decode.{b}' for b in a.decode_batches])
    if bench.over_budget():
        bench.skip_all(keys)
        return None
    try:
        engine = build_engine(bench, prefix_caching)
        t = time.perf_counter()
        engine_warmup(bench, engine, vocab)
        bench.log(f'{tag} warmed up in {time.perf_counter() - t:.1f}s')
        return engine
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        bench.log(f'{tag}: engine build / warm-up FAILED: {exc}')
        bench.fail_all(keys, 'engine build / warm-up', exc)
        bench.free()
        return None


def run_all(bench: Bench, hf_model, vocab: int, dtype: torch.dtype) -> None:
    """Pairs first: each measurement runs on the engine and right after on transformers (both resident), so a
    time budget or a timeout cuts whole comparisons, not one system. Priority: decode, cold TTFT, suffix TTFT."""
    a = bench.args
    use_engine, use_hf = 'engine' in a.systems, 'hf' in a.systems
    hf = prepare_hf(bench, hf_model, dtype, vocab) if use_hf else None
    del hf_model

    # phase 1: engine with prefix caching off (decode + cold TTFT), transformers decode + cold TTFT
    engine = prepare_engine(bench, False, vocab) if use_engine else None
    for b in a.decode_batches:
        if engine is not None:
            bench.measure(f'engine_pc_off.decode.{b}', lambda b=b: engine_decode(bench, engine, b, vocab))
        if hf is not None:
            bench.measure(f'hf.decode.{b}', lambda b=b: in_inference_mode(hf_decode, hf, b, vocab))
    for n in a.cold_sizes:
        measure_cold(bench, 'engine_pc_off', engine, hf, n, vocab)
    engine = None  # free the first KV pool before the second engine sizes its own
    bench.free()

    # phase 2: engine with prefix caching on (cold TTFT, cached-prefix suffix TTFT), transformers suffix TTFT
    engine = prepare_engine(bench, True, vocab) if use_engine else None
    for n in a.cold_sizes:
        measure_cold(bench, 'engine_pc_on', engine, None, n, vocab)
    for n in a.prefix_sizes:
        measure_suffix(bench, 'engine_pc_on', engine, hf, n, vocab)
    if engine is not None:
        with contextlib.suppress(Exception):
            bench.log(f'engine_pc_on prefix-cache stats: {engine.stats}')
    engine = hf = None
    bench.free()


# ----------------------------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--smoke', action='store_true', help='tiny float32 model on the CPU at tiny sizes')
    p.add_argument('--model-dir', default=None, help='checkpoint folder (default /tmp/qwen3next_bench[_smoke])')
    p.add_argument('--rebuild', action='store_true', help='rebuild the checkpoint even if it can be reused')
    p.add_argument('--out', default=None, help='also write the markdown report here')
    p.add_argument('--systems', nargs='+', default=['engine', 'hf'], choices=['engine', 'hf'])
    p.add_argument('--reps', type=int, default=3)
    p.add_argument('--decode-reps', type=int, default=1)
    p.add_argument('--cold-sizes', type=int, nargs='*', default=None)
    p.add_argument('--prefix-sizes', type=int, nargs='*', default=None)
    p.add_argument('--suffix-len', type=int, default=None)
    p.add_argument('--decode-batches', type=int, nargs='*', default=None)
    p.add_argument('--decode-prompt-len', type=int, default=None)
    p.add_argument('--decode-new-tokens', type=int, default=None)
    p.add_argument('--block-size', type=int, default=None)
    p.add_argument('--cache-max-entry-count', type=float, default=0.3)
    p.add_argument('--num-blocks', type=int, default=None, help='KV blocks (0: sized from memory)')
    p.add_argument('--max-batch-size', type=int, default=64)
    p.add_argument('--max-prefill-token-num', type=int, default=None)
    p.add_argument('--session-len', type=int, default=None)
    p.add_argument('--time-budget', type=float, default=0.0,
                   help='seconds; measurements that would start later are skipped (0: no limit)')
    p.add_argument('--request-timeout', type=float, default=300.0,
                   help='seconds one engine run (a batch of requests) may take before it is aborted')
    p.add_argument('--prefill-state-interval', type=int, default=None,
                   help='prefix_cache_prefill_state_interval of the cache-on engine (0: no in-prefill checkpoints; '
                        'default: the engine default)')
    p.add_argument('--check-hf-cache', action='store_true',
                   help='also check that the transformers cached-suffix token equals a full forward (default in smoke)')
    args = p.parse_args(argv)
    if args.smoke:
        defaults = dict(model_dir='/tmp/qwen3next_bench_smoke', cold_sizes=[64, 200], prefix_sizes=[60, 100],
                        suffix_len=12, decode_batches=[1, 4], decode_prompt_len=32, decode_new_tokens=8,
                        block_size=16, num_blocks=256, max_prefill_token_num=128, session_len=1024)
        args.device, args.dtype = 'cpu', 'float32'
        args.check_hf_cache = True
    else:
        defaults = dict(model_dir='/tmp/qwen3next_bench', cold_sizes=[1024, 4096, 16384],
                        prefix_sizes=[924, 3996, 16284], suffix_len=100, decode_batches=[1, 16, 64],
                        decode_prompt_len=512, decode_new_tokens=128, block_size=64, num_blocks=0,
                        max_prefill_token_num=16384, session_len=20000)
        args.device, args.dtype = 'cuda', 'bfloat16'
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == 'cuda' and not torch.cuda.is_available():
        raise SystemExit('bench_vs_transformers needs a CUDA device (or --smoke for the CPU logic check)')
    bench = Bench(args)
    bench.env = collect_env(bench)
    bench.log('env: ' + ', '.join(f'{k}={v}' for k, v in bench.env.items()))
    cfg = SMOKE_CONFIG if args.smoke else FULL_CONFIG
    vocab = cfg['vocab_size']
    dtype = getattr(torch, args.dtype)

    hf_model = None
    if args.rebuild or not _reusable(args.model_dir, cfg):
        t = time.perf_counter()
        try:
            hf_model = build_checkpoint(bench, cfg, dtype)
        except Exception as exc:  # noqa: BLE001 - nothing can run without the checkpoint
            traceback.print_exc()
            raise SystemExit(f'building the checkpoint failed: {exc}') from exc
        bench.log(f'built and saved {args.model_dir} in {time.perf_counter() - t:.1f}s')
    else:
        bench.log(f'reusing {args.model_dir}')

    run_all(bench, hf_model, vocab, dtype)
    del hf_model
    bench.free()

    md = render_markdown(bench)
    print(md)
    bench.write_report()
    rows = build_rows(bench)
    print(json.dumps(dict(bench='vs_transformers', smoke=args.smoke, env=bench.env, rows=rows,
                          results=bench.results, elapsed_s=round(time.perf_counter() - bench.t_start, 1))),
          flush=True)


if __name__ == '__main__':
    main()
