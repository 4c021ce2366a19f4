"""The continuous-batching row of `bench_real_depth.py`: seeded requests of mixed prompt and output lengths arriving
as a Poisson process, fed to the engine by arrival time while it steps, and the share of wall time the device is
busy.

Busy share: the device's own activity records (CUPTI through torch's Kineto profiler: every kernel, memcpy and
memset, CUDA-graph nodes included) collected over the run, their intervals unioned, divided by the run's wall time
(the host's perf_counter from the first arrival to the last request's end, with a device synchronisation at the
end). `busy_share_with_work` divides by the wall time minus the time the engine had no request to run (the host
waiting for the next arrival). The profiler is started through torch's own `profile` object but stopped with the
raw `_disable_profiler` call, so its events are not parsed into a FunctionEvent tree (minutes for a million
kernels). On the CPU (the smoke run) the same code unions CPU op intervals: it checks the logic only.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch
from bench_harness import Bench, Rec, counts_delta, forward_counts, record_into


@dataclass(frozen=True)
class Workload:
    """Request i: `prompts[i]` token ids, exactly `new_tokens[i]` generated, arriving `arrivals[i]` s after t0."""
    prompts: list[list[int]]
    new_tokens: list[int]
    arrivals: list[float]


def poisson_workload(num_requests: int, rate: float, prompt_lens: tuple[int, int], output_lens: tuple[int, int],
                     vocab: int, seed: int = 0) -> Workload:
    """Lengths uniform in the closed ranges, exponential inter-arrival gaps of mean 1 / rate (seeded)."""
    rng = random.Random(seed)
    prompts, new_tokens, arrivals, t = [], [], [], 0.0
    for _ in range(num_requests):
        prompts.append([rng.randrange(vocab) for _ in range(rng.randint(*prompt_lens))])
        new_tokens.append(rng.randint(*output_lens))
        arrivals.append(t)
        t += rng.expovariate(rate)
    return Workload(prompts, new_tokens, arrivals)


def union_length(intervals: list[tuple[int, int]]) -> int:
    """Total length covered by half-open intervals [start, end) (overlaps counted once)."""
    total, cur_start, cur_end = 0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def percentiles(values: list[float], ps: tuple[int, ...] = (50, 90, 99)) -> dict[str, float | None]:
    """Linear-interpolation percentiles (numpy's default), None for no values."""
    if not values:
        return {f'p{p}': None for p in ps}
    xs = sorted(values)
    out = {}
    for p in ps:
        pos = (len(xs) - 1) * p / 100
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        out[f'p{p}'] = xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
    return out


class DeviceActivity:
    """Context manager: the union of the device's activity intervals (ns) while it is open."""

    def __init__(self, device: str):
        self.device = device
        self.busy_ns: int | None = None
        self.num_events = 0
        self.error: str | None = None
        self.span_ns = 0

    def __enter__(self) -> DeviceActivity:
        from torch.autograd import profiler as ap
        cuda = self.device == 'cuda'
        try:
            prof = ap.profile(use_device='cuda' if cuda else None, use_cpu=not cuda, use_kineto=True)
            prof._prepare_trace()
            prof._start_trace()
            self._started = True
        except Exception as err:  # noqa: BLE001 - no profiler leaves the share n/a, not the row
            self.error, self._started = f'profiler start: {type(err).__name__}: {err}'[:300], False
        return self

    def __exit__(self, *exc) -> None:
        from torch.autograd import profiler as ap
        if self.device == 'cuda':
            torch.cuda.synchronize()
        if not self._started:
            return
        try:
            result = ap._disable_profiler()
            kind = torch.autograd.DeviceType.CUDA if self.device == 'cuda' else torch.autograd.DeviceType.CPU
            spans = [(e.start_ns(), e.start_ns() + e.duration_ns()) for e in result.events()
                     if e.device_type() == kind]
        except Exception as err:  # noqa: BLE001
            self.error = f'profiler stop: {type(err).__name__}: {err}'[:300]
            return
        self.num_events = len(spans)
        self.busy_ns = union_length(spans)
        # first start to last end: well under the wall time means the trace lost events (a full CUPTI buffer)
        self.span_ns = max(e for _, e in spans) - min(s for s, _ in spans) if spans else 0


def run_continuous(bench: Bench, engine, workload: Workload) -> dict:
    """Submit each request at its arrival time while stepping the engine; timings per request, busy share. The
    start-up heap is frozen out of the garbage collector's full passes for the run, as the server freezes it
    (`engine/gc_freeze.py`)."""
    from lmdeploy.pytorch.engine.gc_freeze import freeze_heap, release_heap
    froze = freeze_heap()
    try:
        return _run_continuous(bench, engine, workload)
    finally:
        release_heap(froze)


def _run_continuous(bench: Bench, engine, workload: Workload) -> dict:
    from lmdeploy.pytorch.messages import SamplingParams
    recs = [Rec() for _ in workload.prompts]
    idle_s, steps, i = 0.0, 0, 0
    n = len(workload.prompts)
    counts_before = forward_counts(engine)
    with DeviceActivity(bench.device) as activity:
        bench.sync()
        t0 = time.perf_counter()
        deadline = t0 + bench.args.request_timeout
        while i < n or engine.has_work:
            now = time.perf_counter() - t0
            while i < n and workload.arrivals[i] <= now:
                k = workload.new_tokens[i]
                params = SamplingParams(max_new_tokens=k, min_new_tokens=k, temperature=0.0, stop_token_ids=())
                engine.add_request(workload.prompts[i], params, record_into(recs[i]))
                i += 1
            if engine.has_work:
                engine.step()
                steps += 1
            elif i < n:
                wait = workload.arrivals[i] - (time.perf_counter() - t0)
                if wait > 0:
                    time.sleep(wait)
                    idle_s += wait
            if time.perf_counter() > deadline:
                raise TimeoutError(f'continuous run still busy after {bench.args.request_timeout:.0f}s')
        bench.sync()
        wall = time.perf_counter() - t0
    res = summarize(recs, workload, t0, wall, idle_s, steps, activity)
    delta = counts_delta(counts_before, forward_counts(engine))
    if delta is not None:  # where the run's forwards went (idle-time suspects)
        res.update({f'forwards_{k}': v for k, v in delta.items()})
    return res


def summarize(recs: list[Rec], workload: Workload, t0: float, wall: float, idle_s: float, steps: int,
              activity: DeviceActivity) -> dict:
    errors = [r.error for r in recs if r.error]
    if errors:
        raise RuntimeError(f'{len(errors)} request(s) failed: {errors[0]}')
    bad = [i for i, r in enumerate(recs) if len(r.times) != workload.new_tokens[i]]
    if bad:
        raise RuntimeError(f'{len(bad)} request(s) generated the wrong number of tokens (first: request {bad[0]})')
    ttft = [(r.first - t0 - a) * 1e3 for r, a in zip(recs, workload.arrivals)]
    itl = [(b - a) * 1e3 for r in recs for a, b in zip(r.times, r.times[1:])]
    out_tokens = sum(workload.new_tokens)
    res = dict(num_requests=len(recs), wall_s=wall, steps=steps, idle_s=idle_s,
               output_tok_s=out_tokens / wall, total_tok_s=(out_tokens + sum(map(len, workload.prompts))) / wall,
               req_s=len(recs) / wall, offered_rate=len(recs) / max(workload.arrivals[-1], 1e-9),
               ttft_ms=percentiles(ttft), itl_ms=percentiles(itl), device_events=activity.num_events,
               event_span_s=activity.span_ns / 1e9)
    if activity.busy_ns is not None:
        res['busy_share'] = activity.busy_ns / 1e9 / wall
        res['busy_share_with_work'] = activity.busy_ns / 1e9 / max(wall - idle_s, 1e-9)
    else:
        res['busy_error'] = activity.error
    return res
