"""`lmdeploy bench prefix-cache`: replay seeded traces against the engine with the prefix cache off, in 'aligned'
and in 'exact' checkpoint mode, and report hit rate against a capacity-free oracle, TTFT, throughput, matching
cost, checkpoint memory and why prompt tokens were missed.

Per (workload, mode) a fresh pipeline is built, warmed up with one unrelated request, and the trace is driven in
rounds: each round sends the next turn of up to `concurrency` active conversations at once (all submitted before
any is awaited) and waits for all of them, so the submission order, and thus the oracle, is the same in every
mode. Decoding is greedy with `ignore_eos` and a fixed `max_new_tokens`, so every mode must generate the same
tokens; the report says whether it did. Engine figures come from the engine's per-step statistics records only.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..messages import GenerationConfig, PrefixCacheConfig, PytorchEngineConfig
from .engine_probe import EngineProbe
from .images import with_images
from .oracle import RequestTiming, attribute_misses, oracle_hits
from .pressure import (
    PRESSURE_MODES,
    Pools,
    format_pressure_table,
    format_pressure_verdicts,
    parse_pressures,
    pools_at,
    unbounded_pools,
    working_set,
)
from .report import RunResult, compare_outputs, format_table, format_verdicts, has_pressure, summary_json, write_outputs
from .workloads import MULTIMODAL_WORKLOADS, WORKLOADS, Workload, WorkloadSizing, build_workload, conversation_messages

# off: no cache. aligned / exact: state checkpoints at block multiples / at exact prefill and chunk ends, with the
# checkpoint policies off. exact+<policy>: one policy on (its contribution). full: every policy on (the engine's
# default). full-lru: every policy but plain LRU eviction instead of eviction by value. full-aligned: every policy,
# checkpoints at block multiples only.
MODES = ('off', 'aligned', 'exact', 'exact+reply', 'exact+logits', 'exact+branch', 'exact+prefill', 'full',
         'full-lru', 'full-aligned')
_POLICIES = ('reply', 'logits', 'branch', 'prefill', 'value')
DEMO_ARCH = 'qwen3_5'
DEMO_VL_ARCH = 'qwen3_5_vl'  # the default model of the multimodal workloads
# The traces need far less KV than the engine's defaults take (GiBs of zeros on CPU; 80% of the free memory on
# CUDA, which leaves no room for the next mode's engine), so every device gets this many blocks unless told.
_NUM_BLOCKS = 4096
_MIB = float(1 << 20)
_REQUEST_TIMEOUT_S = 600.0  # a stuck engine fails the bench instead of hanging it


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def _modes(value: str) -> tuple[str, ...]:
    if value == 'all':
        return MODES
    modes = tuple(m.strip() for m in value.split(',') if m.strip())
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f'unknown mode(s) {unknown or value!r}; choose from {", ".join(MODES)}')
    return modes


def _workloads(value: str | tuple[str, ...]) -> tuple[str, ...]:
    if isinstance(value, tuple):
        return value
    groups = {'all': WORKLOADS, 'multimodal': MULTIMODAL_WORKLOADS}
    names = tuple(dict.fromkeys(n for v in value.split(',') if v.strip() for n in groups.get(v.strip(), (v.strip(),))))
    unknown = [n for n in names if n not in WORKLOADS + MULTIMODAL_WORKLOADS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f'unknown workload(s) {unknown or value!r}; choose from '
                                         f'{", ".join(WORKLOADS + MULTIMODAL_WORKLOADS)}, all, multimodal')
    return names


def _pressure_modes(value: str | tuple[str, ...]) -> tuple[str, ...]:
    if isinstance(value, tuple):
        return value
    modes = tuple(m.strip() for m in value.split(',') if m.strip())
    unknown = [m for m in modes if m not in PRESSURE_MODES]
    if unknown:
        raise argparse.ArgumentTypeError(f'unknown pressure mode(s) {unknown}; choose from {", ".join(PRESSURE_MODES)}')
    return ('full',) + tuple(m for m in PRESSURE_MODES[1:] if m in modes)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('--model', default=None, help=f'HF folder (default: the {DEMO_ARCH} hybrid demo model)')
    parser.add_argument('--device', default=None, choices=['cpu', 'cuda'], help='default: cuda if available')
    parser.add_argument('--dtype', default='auto', choices=['auto', 'float32', 'bfloat16', 'float16'])
    parser.add_argument('--workload', default='multi_turn', type=_workloads,
                        help=f"one or more (comma-separated, run in that order) of {', '.join(WORKLOADS)}, "
                             f"{', '.join(MULTIMODAL_WORKLOADS)}; 'all': the text workloads; 'multimodal': the "
                             'image workloads (a VL model)')
    parser.add_argument('--mode', default='all', type=_modes,
                        help=f"'all', or one or more (comma-separated) of {', '.join(MODES)}")
    parser.add_argument('--requests', type=int, default=16, help='requests per workload')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--max-new-tokens', type=int, default=16)
    parser.add_argument('--block-size', type=int, default=16, help='tokens per KV block (small so boundaries matter)')
    parser.add_argument('--max-prefill-token-num', type=int, default=256, help='prefill chunk (token budget)')
    parser.add_argument('--concurrency', type=int, default=4, help='conversations in flight at once')
    parser.add_argument('--num-blocks', type=int, default=None,
                        help=f'KV blocks (default: {_NUM_BLOCKS}; 0: sized from memory)')
    parser.add_argument('--max-batch-size', type=int, default=128)
    parser.add_argument('--state-budget', type=int, default=0, help='extra state rows for checkpoints')
    parser.add_argument('--decode-state-interval', type=int, default=0,
                        help='decode checkpoints every N tokens (multiple of --block-size; 0 = off)')
    parser.add_argument('--prefill-state-interval', type=int, default=64,
                        help='in-prefill checkpoints every N tokens in modes with the prefill policy (0 = off; the '
                             'bench scales the engine defaults down to its short traces: block 16, chunk 256, 64)')
    parser.add_argument('--pressure', default='', type=parse_pressures,
                        help="pressure axis: pool sizes in percent of each workload's working set, e.g. '100,50,25' "
                             f"(runs {', '.join(PRESSURE_MODES)} at each level after an unbounded run; default: off)")
    parser.add_argument('--pressure-modes', default=','.join(PRESSURE_MODES), type=_pressure_modes,
                        help='the modes the pressure axis runs at each level (comma-separated subset of '
                             f"{', '.join(PRESSURE_MODES)}; `full` always runs)")
    parser.add_argument('--load-format', default='auto', choices=['auto', 'safetensors', 'dummy'],
                        help="'dummy': random weights from config.json alone (a full-size shape without weights)")
    parser.add_argument('--eager-mode', action='store_true',
                        help='CUDA: no CUDA graphs (every mode builds an engine; hit rates do not depend on graphs, '
                             'and each engine then starts without capturing any)')
    parser.add_argument('--out', default=None, help='folder for report.md and hit_rate.png (and pressure.png)')
    parser.add_argument('--json', action='store_true', help='print one JSON summary as the last stdout line')


@dataclass(frozen=True)
class BenchConfig:
    model_path: str
    device: str
    dtype: str
    workloads: tuple[str, ...]
    modes: tuple[str, ...]
    num_requests: int
    seed: int
    max_new_tokens: int
    block_size: int
    max_prefill_token_num: int
    concurrency: int
    num_blocks: int
    max_batch_size: int
    state_budget: int
    decode_state_interval: int
    prefill_state_interval: int = 64
    # Pool sizes as shares of the working set (pressure.py); () = no pressure axis.
    pressures: tuple[float, ...] = ()
    pressure_modes: tuple[str, ...] = PRESSURE_MODES
    load_format: str = 'auto'
    eager_mode: bool = False

    def __post_init__(self):
        for name in ('num_requests', 'max_new_tokens', 'concurrency'):
            if getattr(self, name) <= 0:
                raise ValueError(f'{name} must be positive, got {getattr(self, name)}')

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchConfig:
        from ..demo_model import get_demo_model_path
        device = args.device or ('cuda' if _has_cuda() else 'cpu')
        num_blocks = args.num_blocks if args.num_blocks is not None else _NUM_BLOCKS
        workloads = _workloads(args.workload)
        demo = DEMO_VL_ARCH if set(workloads) & set(MULTIMODAL_WORKLOADS) else DEMO_ARCH
        return cls(model_path=args.model or get_demo_model_path(demo), device=device, dtype=args.dtype,
                   workloads=workloads,
                   modes=args.mode if isinstance(args.mode, tuple) else _modes(args.mode), num_requests=args.requests,
                   seed=args.seed,
                   max_new_tokens=args.max_new_tokens, block_size=args.block_size,
                   max_prefill_token_num=args.max_prefill_token_num, concurrency=args.concurrency,
                   num_blocks=num_blocks, max_batch_size=args.max_batch_size, state_budget=args.state_budget,
                   decode_state_interval=args.decode_state_interval,
                   prefill_state_interval=args.prefill_state_interval,
                   pressures=args.pressure if isinstance(args.pressure, tuple) else parse_pressures(args.pressure),
                   pressure_modes=_pressure_modes(args.pressure_modes), load_format=args.load_format,
                   eager_mode=args.eager_mode)

    def engine_config(self, mode: str, pools: Pools | None = None) -> PytorchEngineConfig:
        if mode in ('full', 'full-aligned'):
            policies = set(_POLICIES)
        elif mode == 'full-lru':
            policies = set(_POLICIES) - {'value'}
        else:
            policies = {mode.split('+', 1)[1]} if '+' in mode else set()
        pools = pools or Pools(self.num_blocks, self.state_budget, self.max_batch_size)
        return PytorchEngineConfig(
            device_type=self.device, dtype=self.dtype, load_format=self.load_format, eager_mode=self.eager_mode,
            block_size=self.block_size,
            num_gpu_blocks=pools.num_blocks,
            max_batch_size=pools.max_batch_size, max_prefill_token_num=self.max_prefill_token_num,
            enable_prefix_caching=mode != 'off', prefix_cache=PrefixCacheConfig(
                checkpoint_mode='aligned' if mode in ('aligned', 'full-aligned') else 'exact',
                state_budget=pools.state_budget,
                decode_state_interval=self.decode_state_interval, reply_checkpoints='reply' in policies,
                prompt_logits='logits' in policies, branch_checkpoints='branch' in policies,
                value_eviction='value' in policies,
                prefill_state_interval=self.prefill_state_interval if 'prefill' in policies else 0))

    def header(self) -> list[str]:
        return [f'model: `{self.model_path}`, device {self.device}, dtype {self.dtype}',
                f'block size {self.block_size}, max prefill tokens {self.max_prefill_token_num}, KV blocks '
                f'{self.num_blocks or "from memory"}, max batch {self.max_batch_size}, state budget '
                f'{self.state_budget}, decode checkpoint interval {self.decode_state_interval}, '
                f'prefill checkpoint interval {self.prefill_state_interval}',
                f'{self.num_requests} requests per workload, concurrency {self.concurrency}, seed {self.seed}, '
                f'greedy, {self.max_new_tokens} new tokens per request (ignore_eos)']


class _Flight:
    """One submitted request; `on_output` runs on the engine loop thread."""

    def __init__(self, probe: EngineProbe):
        self.probe = probe
        self.token_ids: list[int] = []
        self.margins: list[float] = []
        self.submit_s = self.first_token_s = self.finish_s = 0.0
        self.evictions_at_first_token = 0
        self.cached_tokens = 0
        self.error: str | None = None
        self.done = threading.Event()

    def on_output(self, out) -> None:
        now = time.perf_counter()
        if not self.first_token_s and (out.new_token_ids or out.finished):
            self.first_token_s = now
            self.evictions_at_first_token = self.probe.evictions()
        self.token_ids += out.new_token_ids
        for top in out.logprobs or []:
            best = sorted(top.values(), reverse=True)
            self.margins.append(best[0] - best[1] if len(best) > 1 else float('inf'))
        self.cached_tokens = out.num_cached
        if out.finished:
            self.probe.request_sample()
            self.finish_s, self.error = now, out.error
            self.done.set()


@dataclass(frozen=True)
class RequestRecord:
    conv_id: int
    turn: int
    prompt_ids: list[int]
    output_ids: list[int]
    cached_tokens: int
    timing: RequestTiming
    finish_s: float
    # Per generated token: top-1 minus top-2 logprob (how near a tie the greedy choice was).
    margins: list[float] = field(default_factory=list)


def drive(pipe, workload: Workload, gen: GenerationConfig, concurrency: int, probe: EngineProbe
          ) -> list[RequestRecord]:
    """Run the trace in rounds (see the module docstring); records come back in submission order."""
    engine, tokenizer = pipe.async_engine, pipe.tokenizer
    pending, active, records = deque(workload.conversations), [], []
    while pending or active:
        while pending and len(active) < concurrency:
            active.append((pending.popleft(), [], {}))
        batch = [(conv, replies, history, engine.prepare(_prompt(tokenizer, conv, replies, history), gen))
                 for conv, replies, history in active]
        flights = []
        for _, _, _, request in batch:
            flight = _Flight(probe)
            flight.submit_s = time.perf_counter()
            engine.submit(request, flight.on_output)
            flights.append(flight)
        for (conv, replies, history, request), flight in zip(batch, flights):
            if not flight.done.wait(_REQUEST_TIMEOUT_S):
                raise RuntimeError(f'{workload.name} conversation {conv.conv_id}: no result in {_REQUEST_TIMEOUT_S} s')
            if flight.error:
                raise RuntimeError(f'{workload.name} conversation {conv.conv_id}: {flight.error}')
            records.append(RequestRecord(conv.conv_id, len(replies), _identity_ids(request), flight.token_ids,
                                         flight.cached_tokens, RequestTiming(flight.submit_s, flight.first_token_s,
                                                                             flight.evictions_at_first_token),
                                         flight.finish_s, flight.margins))
            replies.append(tokenizer.decode(flight.token_ids))
            history['ids'], history['reply_ids'] = list(request.input_ids), list(flight.token_ids)
        active = [entry for entry in active if len(entry[1]) < len(entry[0].user_turns)]
    return records


def _prompt(tokenizer, conv, replies: list[str], history: dict):
    """The next request of `conv`: chat messages with drawn images for a multimodal conversation (the engine
    templates and preprocesses them), token ids otherwise."""
    if conv.images:
        return with_images(conversation_messages(conv, len(replies), replies))
    return _prompt_ids(tokenizer, conv, replies, history)


def _identity_ids(request) -> list[int]:
    """The prompt's ids for the oracle, with each image's placeholders replaced by an id derived from its content
    hash (negative, outside the vocabulary): identical placeholders of different images must not count as a
    shared prefix."""
    ids = list(request.input_ids)
    for span in request.mm_spans:
        ids[span.start:span.end] = [-1 - span.content_hash % (1 << 62)] * (span.end - span.start)
    return ids


def _prompt_ids(tokenizer, conv, replies: list[str], history: dict) -> list[int]:
    """Token ids of the next request of `conv`. Like a chat client that keeps token ids, a follow-up turn resends
    the previous prompt's ids and the reply's generated ids verbatim, then the tokenized rest of the templated
    history (decoding and re-encoding a reply need not give back the same ids, least of all for the random-weight
    demo model)."""
    text = tokenizer.apply_chat_template(conversation_messages(conv, len(replies), replies))
    if conv.keep_history and replies and 'text' in history:
        head = history['text'] + replies[-1]
        if text.startswith(head):
            ids = history['ids'] + history['reply_ids'] + tokenizer.encode(text[len(head):], add_special_tokens=False)
            history['text'] = text
            return ids
    history['text'] = text
    return tokenizer.encode(text, add_special_tokens=False)


def _outputs_digest(records: list[RequestRecord]) -> str:
    keyed = sorted((r.conv_id, r.turn, r.output_ids) for r in records)
    return hashlib.sha1(json.dumps(keyed).encode()).hexdigest()[:12]


def summarize(workload: str, mode: str, records: list[RequestRecord], probe: EngineProbe,
              pressure: float | None = None) -> RunResult:
    prompt_lens = [len(r.prompt_ids) for r in records]
    cached = [r.cached_tokens for r in records]
    hits = oracle_hits([r.prompt_ids for r in records], [r.output_ids for r in records])
    stats = probe.engine.stats  # waits for the engine's last step to end
    probe.sample()
    engine_reasons = stats.get('miss_reasons')
    reasons = dict(engine_reasons) if engine_reasons else attribute_misses(
        prompt_lens, cached, hits, [r.timing for r in records], is_cache_enabled=probe.is_cache_enabled)
    ttft_ms = np.array([(r.timing.first_token_s - r.timing.submit_s) * 1000 for r in records])
    wall = max(r.finish_s for r in records) - min(r.timing.submit_s for r in records)
    generated = sum(len(r.output_ids) for r in records)
    total = sum(prompt_lens)
    return RunResult(
        workload=workload, mode=mode, num_requests=len(records), prompt_tokens=total, cached_tokens=sum(cached),
        generated_tokens=generated, hit_rate=sum(cached) / total,
        oracle_hit_rate=sum(h.num_tokens for h in hits) / total,
        ttft_p50_ms=float(np.percentile(ttft_ms, 50)), ttft_p95_ms=float(np.percentile(ttft_ms, 95)),
        throughput_tok_s=generated / wall if wall > 0 else 0.0, wall_s=wall,
        match_ms_per_request=probe.match_s * 1000 / len(records), match_calls=probe.match_calls,
        checkpoint_mib_peak=probe.peak_bytes / _MIB, checkpoint_mib_final=probe.checkpoint_bytes() / _MIB,
        live_checkpoints=probe.live_checkpoints(), checkpoints_saved=probe.stat_delta('checkpoints_saved'),
        evicted_checkpoints=probe.stat_delta('evicted_checkpoints'), evicted_blocks=probe.stat_delta('evicted_blocks'),
        miss_reasons=reasons, miss_reasons_source='engine' if engine_reasons else 'bench',
        outputs_digest=_outputs_digest(records), outputs={f'{r.conv_id}:{r.turn}': r.output_ids for r in records},
        margins={f'{r.conv_id}:{r.turn}': r.margins for r in records},
        pressure=pressure, num_blocks=probe.engine.cache_config.num_blocks,
        checkpoint_rows=probe.engine.stats_snapshot.checkpoint_rows,
        evictions_by_cause=probe.evictions_by_cause(), peak_kv_blocks=probe.peak_blocks,
        peak_checkpoints=probe.peak_checkpoints,
        max_request_tokens=max(len(r.prompt_ids) + len(r.output_ids) for r in records))


def _warm_up(pipe) -> None:
    """One short request without the chat template, so it shares no prefix with the (templated) traces."""
    ids = pipe.tokenizer.encode('warm up the kernels before timing anything', add_special_tokens=False)
    pipe(ids, GenerationConfig(max_new_tokens=2, ignore_eos=True), do_preprocess=False)


def run_mode(config: BenchConfig, workload_name: str, mode: str, workload: Workload | None,
             pools: Pools | None = None, pressure: float | None = None) -> tuple[RunResult, Workload]:
    """One (workload, mode) run on a fresh engine; builds the workload on first use (it needs the tokenizer)."""
    from ..serve.pipeline import pipeline
    # top-2 logprobs: where a mode's greedy tokens part from the reference's, the report gives how near a tie it was
    gen = GenerationConfig(max_new_tokens=config.max_new_tokens, ignore_eos=True, logprobs=2)
    with pipeline(config.model_path, config.engine_config(mode, pools)) as pipe:
        if workload is None:
            sizing = WorkloadSizing(config.max_prefill_token_num,
                                    pipe.session_len - 3 * config.max_new_tokens - 64)
            workload = build_workload(workload_name, config.num_requests, config.seed, sizing,
                                      lambda text: len(pipe.tokenizer.encode(text, add_special_tokens=False)))
        probe = EngineProbe(pipe.engine)
        _warm_up(pipe)
        probe.reset()
        records = drive(pipe, workload, gen, config.concurrency, probe)
        return summarize(workload_name, mode, records, probe, pressure), workload


def _release_device_memory() -> None:
    """Free the finished run's engine (pools, CUDA graphs) before the next mode builds its own."""
    import gc

    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_bench(config: BenchConfig, log=None) -> list[RunResult]:
    """Every (workload, mode); with a pressure axis, `full` runs unbounded first (its peaks are the working set),
    the other modes unbounded too, then every pressure mode (pressure.py) at each pressure level. Progress goes to
    `log` (default: `sys.stderr` as it is at the call, not at import, which a test's capture may have replaced)."""
    log = sys.stderr if log is None else log
    results = []
    for name in config.workloads:
        workload = None
        modes = config.modes
        unbounded = None
        if config.pressures:
            modes = ('full',) + tuple(m for m in modes if m != 'full')
            unbounded = unbounded_pools(config.num_blocks, config.num_requests, config.concurrency)
        for mode in modes:
            result, workload = run_mode(config, name, mode, workload, unbounded)
            results.append(_report(result, log))
        if config.pressures:
            full = results[-len(modes)]
            ws = working_set(full.peak_kv_blocks, full.peak_checkpoints, full.max_request_tokens, config.block_size,
                             config.concurrency)
            for pressure in config.pressures:
                for mode in config.pressure_modes:
                    result, workload = run_mode(config, name, mode, workload, pools_at(ws, pressure,
                                                                                       config.concurrency), pressure)
                    results.append(_report(result, log))
            # This workload's pressure table now, so that a run cut short still leaves the workloads it finished.
            done = [r for r in results if r.workload == name]
            print(format_pressure_table(done), format_pressure_verdicts(done), sep='\n', file=log, flush=True)
    return compare_outputs(results)


def _report(result: RunResult, log) -> RunResult:
    _release_device_memory()
    at = '' if result.pressure is None else f' @ {result.pressure:.0%}'
    print(f'[bench] {result.workload}/{result.mode}{at}: hit rate {result.hit_rate:.3f} ({result.cached_tokens} of '
          f'{result.prompt_tokens} tokens; oracle {result.oracle_hit_rate:.3f}), TTFT p50 {result.ttft_p50_ms:.1f} ms, '
          f'{result.wall_s:.1f} s, pools '
          f'{result.num_blocks} blocks / {result.checkpoint_rows} ckpt rows, evicted {result.evictions_by_cause}',
          file=log, flush=True)
    return result


def run_cli(args: argparse.Namespace) -> int:
    config = BenchConfig.from_args(args)
    results = run_bench(config)
    print(format_table(results))
    print(format_verdicts(results))
    if has_pressure(results):
        print(format_pressure_table(results))
        print(format_pressure_verdicts(results))
    if args.out:
        md, png = write_outputs(results, args.out, config.header())
        print(f'wrote {md} and {png}')
    if args.json:
        print(json.dumps(summary_json(results)), flush=True)
    return 0
