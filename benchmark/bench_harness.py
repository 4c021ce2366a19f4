"""Shared parts of the engine-vs-transformers benchmarks (`bench_vs_transformers.py`, `bench_real_depth.py`).

What both need: the results dict with its incremental report and time budget (`Bench`), seeded prompts, the engine
driven request by request with per-token timestamps (`engine_run`, `record_into`), transformers one forward at a time
on its own cache (`HF`), and the cold / cached-suffix TTFT measurements that both scripts run the same way on the
two systems. Imported by name: the scripts put `benchmark/` first on `sys.path` when run as `python benchmark/X.py`.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


class Bench:
    """Device helpers, the results dict and the incremental report (`render`, rewritten to `args.out` after every
    measurement). `args` needs `device`, `out`, `time_budget` and, for `engine_run`, `request_timeout`."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.device = args.device
        self.results: dict[str, dict] = {}
        self.env: dict = {}
        self.t_start = time.perf_counter()

    def sync(self) -> None:
        if self.device == 'cuda':
            torch.cuda.synchronize()

    def free(self) -> None:
        gc.collect()
        if self.device == 'cuda':
            torch.cuda.empty_cache()

    def log(self, msg: str) -> None:
        print(f'[bench {time.perf_counter() - self.t_start:7.1f}s] {msg}', flush=True)

    def over_budget(self) -> bool:
        budget = self.args.time_budget
        return budget > 0 and time.perf_counter() - self.t_start > budget

    def skip_all(self, keys: list[str]) -> None:
        for key in keys:
            self.results.setdefault(key, {'skipped': f'time budget ({self.args.time_budget:.0f}s) spent'})
        self.log(f'time budget spent: skipping {", ".join(keys)}')
        self.write_report()

    def measure(self, key: str, fn: Callable[[], dict]) -> dict | None:
        """Run one measurement; a failure is printed and recorded, never raised."""
        if self.over_budget():
            self.skip_all([key])
            return None
        try:
            res = fn()
            self.results[key] = res
            self.log(f'{key}: {_brief(res)}')
            return res
        except Exception as exc:  # noqa: BLE001 - every measurement is independent
            traceback.print_exc()
            self.results[key] = {'error': f'{type(exc).__name__}: {exc}'[:500]}
            self.log(f'{key}: FAILED ({type(exc).__name__}: {str(exc)[:200]})')
            self.free()
            return None
        finally:
            self.write_report()

    def fail_all(self, keys: list[str], what: str, exc: BaseException) -> None:
        for key in keys:
            self.results.setdefault(key, {'error': f'{what} failed: {type(exc).__name__}: {exc}'[:500]})
        self.write_report()

    def problem_lines(self) -> list[str]:
        """Report lines for the measurements that failed or were skipped (empty when none)."""
        lines = []
        errors = {k: v['error'] for k, v in self.results.items() if 'error' in v}
        if errors:
            lines += ['', 'errors:'] + [f'- `{k}`: {v}' for k, v in errors.items()]
        skipped = [k for k, v in self.results.items() if 'skipped' in v]
        if skipped:
            lines += ['', f'skipped (time budget): {", ".join(skipped)}']
        return lines

    def render(self) -> str:
        """The report; subclasses render their table."""
        return json.dumps(self.results, indent=1, default=str)

    def write_report(self) -> None:
        if not self.args.out:
            return
        try:
            os.makedirs(os.path.dirname(os.path.abspath(self.args.out)), exist_ok=True)
            with open(self.args.out, 'w') as f:
                f.write(self.render() + '\n')
        except OSError as exc:
            print(f'could not write {self.args.out}: {exc}', file=sys.stderr)




def _brief(res: dict) -> str:
    return ', '.join(f'{k}={v:.4g}' if isinstance(v, float) else f'{k}={v}' for k, v in res.items()
                     if not isinstance(v, list | dict))


def make_prompt(length: int, seed: int, vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=gen).tolist()


def seed_of(kind: str, size: int, rep: int) -> int:
    """Deterministic seeds shared by both systems; rep -1 is the untimed warm-up repetition."""
    return {'cold': 1, 'prefix': 2, 'suffix': 3, 'decode': 4}[kind] * 10_000_000 + size * 100 + rep + 1


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def import_status(name: str) -> str:
    try:
        mod = importlib.import_module(name)
        return f'yes ({getattr(mod, "__version__", "?")})'
    except Exception as exc:  # noqa: BLE001 - any import failure is just reported
        return f'no ({type(exc).__name__}: {str(exc)[:120]})'


def collect_env(bench: Bench) -> dict:
    import transformers
    env = {'torch': torch.__version__, 'transformers': transformers.__version__, 'triton': import_status('triton'),
           'fla': import_status('fla'), 'causal_conv1d': import_status('causal_conv1d'), 'device': bench.device}
    if bench.device == 'cuda':
        env['gpu'] = torch.cuda.get_device_name()
    try:
        from lmdeploy.pytorch.backends.selector import get_backend
        env['engine_backend'] = getattr(get_backend(bench.device), 'name', type(get_backend(bench.device)).__name__)
    except Exception as exc:  # noqa: BLE001
        env['engine_backend'] = f'? ({exc})'
    return env


# engine
@dataclass
class Rec:
    """One request as the engine delivered it: first-token and end times, every token's time (perf_counter)."""
    first: float | None = None
    first_token: int | None = None
    end: float | None = None
    times: list[float] = field(default_factory=list)
    num_cached: int = 0
    reason: str | None = None
    error: str | None = None


def record_into(rec: Rec) -> Callable:
    """An engine output callback that timestamps every token of one request into `rec`."""
    def on_output(out) -> None:
        now = time.perf_counter()
        if out.new_token_ids:
            if rec.first is None:
                rec.first, rec.first_token = now, out.new_token_ids[0]
            rec.times.extend([now] * len(out.new_token_ids))
        rec.num_cached = max(rec.num_cached, out.num_cached)
        if out.error:
            rec.error = out.error
        if out.finished:
            rec.end, rec.reason = now, out.finish_reason
    return on_output


def engine_run(bench: Bench, engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[Rec]]:
    """Submit all prompts at once, step to idle; returns (t0, per-request records)."""
    from lmdeploy.pytorch.messages import SamplingParams
    params = SamplingParams(max_new_tokens=new_tokens, min_new_tokens=new_tokens, temperature=0.0,
                            stop_token_ids=())
    recs = [Rec() for _ in prompts]

    bench.sync()
    t0 = time.perf_counter()
    seq_ids = []
    try:
        for prompt, rec in zip(prompts, recs):
            seq_ids.append(engine.add_request(prompt, params, record_into(rec)))
        deadline = t0 + bench.args.request_timeout
        while engine.has_work:
            if time.perf_counter() > deadline:
                raise TimeoutError(f'engine still busy after {bench.args.request_timeout:.0f}s')
            engine.step()
        bench.sync()
    except BaseException:
        # leave the engine idle for the next measurement
        with contextlib.suppress(Exception):
            for seq_id in seq_ids:
                engine.abort_request(seq_id)
            for _ in range(100):
                if not engine.has_work:
                    break
                engine.step()
        raise
    errors = [r.error for r in recs if r.error]
    if errors:
        raise RuntimeError(f'{len(errors)} request(s) failed: {errors[0]}')
    if any(r.first is None or r.end is None for r in recs):
        raise RuntimeError('a request finished without output')
    return t0, recs



def forward_counts(engine) -> dict | None:
    """The engine's `ModelAgent.forward_counts()` (None for an agent without them, e.g. tensor parallelism)."""
    counts = getattr(getattr(engine, 'agent', None), 'forward_counts', None)
    return counts() if counts is not None else None


def counts_delta(before: dict | None, after: dict | None) -> dict | None:
    """`forward_counts` over a stretch (None when either side is)."""
    return None if before is None or after is None else {k: after[k] - before[k] for k in after}


def _forward_kinds(deltas: list[dict | None]) -> dict:
    """How each timed request's forwards ran: `eager_forwards` / `graph_forwards` per rep (a row that ran eagerly
    where a graph was expected says so here: the 32K suffix cliff of H200 run 14)."""
    if any(d is None for d in deltas):
        return {}
    return {'eager_forwards': [d['eager'] for d in deltas],
            'graph_forwards': [d['graph_replays'] + d['graph_first_uses'] for d in deltas]}


def engine_cold_ttft(bench: Bench, engine, size: int, vocab: int) -> dict:
    ttfts, tokens, kinds = [], [], []
    for rep in range(-1, bench.args.reps):
        before = forward_counts(engine)
        t0, (rec,) = engine_run(bench, engine, [make_prompt(size, seed_of('cold', size, rep), vocab)], 1)
        if rep >= 0:
            ttfts.append((rec.first - t0) * 1e3)
            tokens.append(rec.first_token)
            kinds.append(counts_delta(before, forward_counts(engine)))
    return {'ttft_ms': median(ttfts), 'ttft_ms_all': ttfts, 'first_tokens': tokens, **_forward_kinds(kinds)}


def engine_suffix_ttft(bench: Bench, engine, prefix_len: int, vocab: int) -> dict:
    suffix_len = bench.args.suffix_len
    ttfts, cached, tokens, kinds = [], [], [], []
    for rep in range(-1, bench.args.reps):
        prefix = make_prompt(prefix_len, seed_of('prefix', prefix_len, rep), vocab)
        suffix = make_prompt(suffix_len, seed_of('suffix', prefix_len, rep), vocab)
        engine_run(bench, engine, [prefix], 1)
        before = forward_counts(engine)
        t0, (rec,) = engine_run(bench, engine, [prefix + suffix], 1)
        if rep >= 0:
            ttfts.append((rec.first - t0) * 1e3)
            cached.append(rec.num_cached)
            tokens.append(rec.first_token)
            kinds.append(counts_delta(before, forward_counts(engine)))
    if min(cached) < prefix_len:
        bench.log(f'WARNING: suffix after {prefix_len}: only {cached} prompt tokens served from the prefix cache')
    return {'ttft_ms': median(ttfts), 'ttft_ms_all': ttfts, 'num_cached': cached, 'first_tokens': tokens,
            **_forward_kinds(kinds)}


def engine_warmup(bench: Bench, engine, vocab: int) -> None:
    """One request, then four at once (64-token prompts, 4 new tokens): the paths every row runs compile here."""
    engine_run(bench, engine, [make_prompt(64, 7, vocab)], 4)
    engine_run(bench, engine, [make_prompt(64, 8 + i, vocab) for i in range(4)], 4)


# transformers
class HF:
    """A transformers model plus the version differences: 5.17 takes/returns `past_key_values`, newer `cache`."""

    def __init__(self, bench: Bench, model):
        import inspect
        self.bench, self.model = bench, model
        params = inspect.signature(model.forward).parameters
        self.cache_kwarg = 'cache' if 'cache' in params else 'past_key_values'
        model.generation_config.eos_token_id = None  # exactly max_new_tokens
        model.generation_config.pad_token_id = 0

    def ids(self, prompts: list[list[int]]) -> torch.Tensor:
        return torch.tensor(prompts, dtype=torch.long, device=self.bench.device)

    def forward(self, input_ids: torch.Tensor, cache=None):
        kwargs = {self.cache_kwarg: cache} if cache is not None else {}
        out = self.model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **kwargs)
        new_cache = getattr(out, 'cache', None)
        if new_cache is None:
            new_cache = getattr(out, 'past_key_values', None)
        return out.logits[:, -1].argmax(-1), new_cache

    def timed_forward(self, input_ids: torch.Tensor, cache=None) -> tuple[float, list[int]]:
        self.bench.sync()
        t0 = time.perf_counter()
        tokens, _ = self.forward(input_ids, cache)
        tokens = tokens.tolist()
        self.bench.sync()
        return (time.perf_counter() - t0) * 1e3, tokens


def hf_cold_ttft(hf: HF, size: int, vocab: int) -> dict:
    ttfts, tokens = [], []
    for rep in range(-1, hf.bench.args.reps):
        ms, tok = hf.timed_forward(hf.ids([make_prompt(size, seed_of('cold', size, rep), vocab)]))
        if rep >= 0:
            ttfts.append(ms)
            tokens.append(tok[0])
    return {'ttft_ms': median(ttfts), 'ttft_ms_all': ttfts, 'first_tokens': tokens}


def hf_suffix_ttft(hf: HF, prefix_len: int, vocab: int) -> dict:
    suffix_len = hf.bench.args.suffix_len
    ttfts, tokens = [], []
    check = None
    for rep in range(-1, hf.bench.args.reps):
        prefix = make_prompt(prefix_len, seed_of('prefix', prefix_len, rep), vocab)
        suffix = make_prompt(suffix_len, seed_of('suffix', prefix_len, rep), vocab)
        _, cache = hf.forward(hf.ids([prefix]))  # a fresh cache per repetition: it is mutated in place
        if cache is None:
            raise RuntimeError('transformers returned no cache')
        ms, tok = hf.timed_forward(hf.ids([suffix]), cache)
        del cache
        if rep >= 0:
            ttfts.append(ms)
            tokens.append(tok[0])
        if rep == 0 and hf.bench.args.check_hf_cache:
            # the cached suffix forward must pick the same token as one forward over prefix + suffix
            full, _ = hf.forward(hf.ids([prefix + suffix]))
            check = int(full.item()) == tok[0]
    res = {'ttft_ms': median(ttfts), 'ttft_ms_all': ttfts, 'first_tokens': tokens}
    if check is not None:
        res['cache_matches_full_forward'] = check
    return res


def in_inference_mode(fn: Callable[..., dict], *args) -> dict:
    with torch.inference_mode():
        return fn(*args)


def measure_cold(bench: Bench, tag: str, engine, hf: HF | None, size: int, vocab: int) -> None:
    """Cold TTFT of `size` tokens: `{tag}.cold.{size}` on the engine, then `hf.cold.{size}` on transformers (either
    None: that row is not run)."""
    if engine is not None:
        bench.measure(f'{tag}.cold.{size}', lambda: engine_cold_ttft(bench, engine, size, vocab))
    if hf is not None:
        bench.measure(f'hf.cold.{size}', lambda: in_inference_mode(hf_cold_ttft, hf, size, vocab))


def measure_suffix(bench: Bench, tag: str, engine, hf: HF | None, prefix_len: int, vocab: int) -> None:
    """TTFT of the suffix after a cached `prefix_len`-token prefix: `{tag}.suffix.{n}` on the engine, then
    `hf.suffix.{n}` on transformers' own cache (either None: that row is not run)."""
    if engine is not None:
        bench.measure(f'{tag}.suffix.{prefix_len}', lambda: engine_suffix_ttft(bench, engine, prefix_len, vocab))
    if hf is not None:
        bench.measure(f'hf.suffix.{prefix_len}', lambda: in_inference_mode(hf_suffix_ttft, hf, prefix_len, vocab))


