"""The measured rows of `bench_real_depth.py` beyond the TTFT rows of `bench_harness`: the first request after
start-up against a later one, decode tokens/s of the engine and of transformers, and the continuous-batching run.

Decode on the engine (`engine_decode`) with the synchronous loop and with async scheduling alike: `batch` requests
are submitted and stepped until every one has its first token (prefills of several steps stagger them), then
`SETTLE` more steps, then `--decode-steps` steps are timed, the device synchronised at both ends. The requests ask
for more tokens than the window needs and are aborted after it, so none finishes inside it. Each step's forward is
read from the engine's per-step record (`Engine.stats_snapshot.batch`, `engine_stats.StepBatch`): the forward the
last step before the window launched and each one a window step launched must be a pure decode batch of exactly
`batch` sequences and `batch` tokens (`check_decode_window`), else the row fails. The window then launched
`steps` full decode forwards, and tok/s = steps x batch / time. With async scheduling a step delivers the tokens of
the forward before it, so the tokens delivered in the window (`delivered_tokens`, counted from the outputs) come
from the forward in flight at its start up to the one before its last; the forward the last step launched is
waited for by the closing synchronisation, and the one in flight at the start finished before it (the opening
one). Both counts are batch x steps when every step settles exactly the forward before it (`overlapped_steps`:
steps launched while another was in flight, `steps` in a fully overlapped window).
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
from bench_harness import HF, Bench, Rec, engine_run, make_prompt, record_into, seed_of
from real_depth_serving import poisson_workload, run_continuous

SETTLE = 2  # steps after the last first token before the window (the first decode batches of the staggered prefills)


def first_vs_later(bench: Bench, engine, startup_s: float, vocab: int) -> dict:
    """The first request after start-up against a later one of the same length (different tokens)."""
    n, new = bench.args.first_request_len, 8
    out = {'startup_s': startup_s, 'prompt_len': n, 'new_tokens': new}
    for name, seed in (('first', 11), ('later', 12), ('later2', 13)):
        t0, (rec,) = engine_run(bench, engine, [make_prompt(n, seed, vocab)], new)
        out[f'{name}_ms'] = (rec.end - t0) * 1e3
        out[f'{name}_ttft_ms'] = (rec.first - t0) * 1e3
    out['later_ms'] = min(out['later_ms'], out.pop('later2_ms'))
    out['later_ttft_ms'] = min(out['later_ttft_ms'], out.pop('later2_ttft_ms'))
    return out


def check_decode_window(batches: list, batch: int) -> None:
    """Raise unless every `StepBatch` is a pure decode batch of `batch` sequences feeding one token each."""
    bad = [(i, b) for i, b in enumerate(batches)
           if not (b.num_seqs == batch and b.num_decode_seqs == batch and b.num_tokens == batch)]
    if bad:
        i, b = bad[0]
        raise RuntimeError(f'{len(bad)} of {len(batches)} steps in the decode window were not one decode batch of '
                           f'{batch}: step {i} ran {b.num_seqs} sequences ({b.num_decode_seqs} decoding), '
                           f'{b.num_tokens} tokens')


def decode_window(bench: Bench, engine, batch: int, prompt_len: int, steps: int, seed: int, vocab: int,
                  around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> dict:
    """One decode window (module docstring), its steps and both synchronisations inside `around()` (a profiler);
    the requests are aborted after it and the engine left idle."""
    from lmdeploy.pytorch.messages import SamplingParams
    a = bench.args
    # more than the window needs: the prefills (at most 2 x batch x prompt / budget steps) stagger the first tokens
    stagger = 2 * -(-batch * prompt_len // a.max_prefill_token_num) + 2
    new = min(engine.session_len - prompt_len, SETTLE + steps + stagger + 2)
    params = SamplingParams(max_new_tokens=new, min_new_tokens=new, temperature=0.0, stop_token_ids=())
    recs = [Rec() for _ in range(batch)]
    ids = [engine.add_request(make_prompt(prompt_len, seed * 1000 + i, vocab), params, record_into(rec))
           for i, rec in enumerate(recs)]
    try:
        deadline = time.perf_counter() + a.request_timeout
        while any(r.first is None and r.error is None for r in recs) and time.perf_counter() < deadline:
            engine.step()
        for _ in range(SETTLE):
            engine.step()
        with around():
            bench.sync()
            batches = [engine.stats_snapshot.batch]
            overlapped0, t0 = engine.num_overlapped_steps, time.perf_counter()
            delivered0 = sum(len(r.times) for r in recs)
            for _ in range(steps):
                engine.step()
                batches.append(engine.stats_snapshot.batch)
            bench.sync()
            elapsed = time.perf_counter() - t0
        delivered = sum(len(r.times) for r in recs) - delivered0
        overlapped = engine.num_overlapped_steps - overlapped0
    finally:
        for seq_id in ids:
            engine.abort_request(seq_id)
        engine.run_until_idle()
    errors = [r.error for r in recs if r.error]
    if errors:
        raise RuntimeError(f'{len(errors)} request(s) failed: {errors[0]}')
    if any(r.first is None for r in recs):
        raise RuntimeError(f'not every request had its first token after {a.request_timeout:.0f}s')
    check_decode_window(batches, batch)
    return {'decode_tok_s': steps * batch / elapsed, 'step_ms': elapsed / steps * 1e3, 'steps': steps,
            'delivered_tokens': delivered, 'overlapped_steps': overlapped}


def engine_decode(bench: Bench, engine, batch: int, vocab: int) -> dict:
    """tokens/s over `--decode-steps` engine steps once every request has its first token (prefill excluded)."""
    a = bench.args
    decode_window(bench, engine, batch, min(64, a.decode_prompt_len), 3, seed_of('decode', batch, -1), vocab)
    res = decode_window(bench, engine, batch, a.decode_prompt_len, a.decode_steps, seed_of('decode', batch, 0),
                         vocab)
    res['async_scheduling'] = bool(engine.async_scheduling)
    return res


def hf_decode(hf: HF, batch: int, vocab: int) -> dict:
    """tokens/s of transformers' forward loop on its own cache (greedy argmax fed back; prefill excluded)."""
    a = hf.bench.args

    def run(prompt_len: int, steps: int, seed: int) -> float:
        ids = hf.ids([make_prompt(prompt_len, seed * 1000 + i, vocab) for i in range(batch)])
        tokens, cache = hf.forward(ids)
        for _ in range(2):
            tokens, cache = hf.forward(tokens[:, None], cache)
        hf.bench.sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            tokens, cache = hf.forward(tokens[:, None], cache)
        hf.bench.sync()
        return time.perf_counter() - t0

    with torch.inference_mode():
        run(min(64, a.decode_prompt_len), 2, seed_of('decode', batch, -1))
        elapsed = run(a.decode_prompt_len, a.decode_steps, seed_of('decode', batch, 0))
    return {'decode_tok_s': batch * a.decode_steps / elapsed, 'step_ms': elapsed / a.decode_steps * 1e3}


def continuous(bench: Bench, engine, vocab: int) -> dict:
    a = bench.args
    work = poisson_workload(a.cb_requests, a.cb_rate, tuple(a.cb_prompt_len), tuple(a.cb_output_len), vocab, seed=5)
    return run_continuous(bench, engine, work)
