"""Engine soak on CPU: hundreds of random requests through tiny KV and state pools, with aborts, on a tiny hybrid
Qwen3.5 with prefix caching, against a cache-off control engine.

The driver calls `Engine.step()` itself. Requests arrive a few per step; their prompts share prefixes at random
(non-aligned) boundaries, repeat earlier prompts exactly, or continue an earlier prompt with its reply (a chat
turn). Faults: aborts right after submit, aborts mid-generation, and aborts of a request whose restore copies are
in the forward being run (sent from inside `schedule()`, as another thread would; the engine applies them at the
next step). Tiny pools force evictions and preemptions.

Checked: the KV / state-slot accounting after every step; no restore pin outlives its step; every completed
greedy output equals the control's, and every aborted request's partial output is a prefix of it (where the
control's top-2 logit gap is below `TIE_TOL` a divergence is a near tie, counted, not a failure); at the end
nothing is running or waiting, every block and slot is owned by the prefix cache only, and evicting the cache frees
everything.

CI size: `test_soak` (~120 requests). Long: `pytest -m slow tests/engine/test_soak.py` or
`python -m tests.engine.test_soak --long`; under tensor parallelism (TP=2, two processes, gloo)
`test_soak_tp2_matches_the_tp1_control` (short) and `test_soak_tp2_full_size` (`slow`), or `--tp 2`
(`LMDEPLOY_SOAK_REQUESTS` sets the number of requests of the long run).
"""
from __future__ import annotations

import argparse
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.messages import SamplingParams

SEED = 20250611
CI_REQUESTS = 120
LONG_REQUESTS = 1200
BLOCK_SIZE = 16
VOCAB = 1000          # prompt token ids are drawn from [0, VOCAB); the tiny model's vocabulary is 1024
TIE_TOL = 1e-3        # a greedy divergence where the control's top-2 logit gap is below this is a near tie
# Head counts that divide over 2 ranks with n_v / n_k = 3 (the tiny model's defaults give 1 gated-delta key head)
TP_HYBRID = dict(linear_num_key_heads=2, linear_num_value_heads=6, num_attention_heads=4, num_key_value_heads=2)


@dataclass(frozen=True)
class Pool:
    """One soak scenario: tiny KV and state pools (state rows = dummy + batch + spare + budget)."""
    num_blocks: int
    max_batch_size: int
    state_budget: int
    max_prefill: int

    @property
    def max_tokens(self) -> int:
        # Prompt + generated tokens of one request: at most half the pool. Bigger requests can livelock the
        # scheduler (see test_fuzz_paging.py: test_hit_needing_the_whole_pool_is_admitted_cold and
        # test_request_is_not_starved_by_duplicate_interior_nodes).
        return (self.num_blocks - 1) // 2 * BLOCK_SIZE


POOLS = (Pool(12, 3, 0, 48), Pool(16, 3, 2, 64), Pool(20, 4, 1, 40))


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    seq_id: int = 0
    tokens: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    num_cached: int = 0
    abort: str | None = None          # how it was aborted: 'submit', 'mid', 'restore'

    def on_output(self, out) -> None:
        self.tokens += out.new_token_ids
        self.num_cached = out.num_cached
        if out.finished:
            self.finished, self.finish_reason, self.error = True, out.finish_reason, out.error


class Workload:
    """Prompts over a few shared prefixes: branches cut at random boundaries, exact repeats, chat continuations."""

    def __init__(self, rng: random.Random, max_tokens: int):
        self.rng, self.max_tokens = rng, max_tokens
        self.families = [self._tokens(rng.randrange(max_tokens // 3, max_tokens - 8)) for _ in range(2)]
        self.history: list[Request] = []

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(n)]

    def next(self) -> Request:
        rng = self.rng
        max_new = rng.randint(1, 16)
        room = self.max_tokens - max_new
        kind = rng.choices(['branch', 'repeat', 'turn', 'fresh'], weights=[4, 3, 3, 1])[0]
        # Traffic has locality: repeats and follow-up turns pick among the latest requests.
        recent = self.history[-6:]
        done = [r for r in recent if r.finished and not r.error]
        if kind == 'repeat' and recent:
            prompt = list(rng.choice(recent).prompt)
        elif kind == 'turn' and done:
            prev = rng.choice(done)
            prompt = prev.prompt + prev.tokens + self._tokens(rng.randint(1, 12))
        elif kind == 'fresh':
            prompt = self._tokens(rng.randint(1, room))
        else:
            base = rng.choice(self.families)
            prompt = base[:rng.randint(1, len(base))] + self._tokens(rng.randint(0, 12))
        request = Request(prompt[:room] or [1], max_new)
        self.history.append(request)
        return request


@dataclass
class Figures:
    counts: Counter = field(default_factory=Counter)
    seconds: float = 0.0

    def line(self) -> str:
        return ', '.join(f'{k}={v}' for k, v in sorted(self.counts.items())) + f', seconds={self.seconds:.1f}'


def make_engine(path: str, pool: Pool | None, tp: int = 1) -> Engine:
    if pool is None:  # the cache-off control: roomy, batched
        config = PytorchEngineConfig(device_type='cpu', block_size=BLOCK_SIZE, kernel_block_size=8,
                                     num_gpu_blocks=512, max_batch_size=16, max_prefill_token_num=4096)
    else:
        config = PytorchEngineConfig(device_type='cpu', block_size=BLOCK_SIZE, kernel_block_size=8,
                                     num_gpu_blocks=pool.num_blocks, max_batch_size=pool.max_batch_size,
                                     max_prefill_token_num=pool.max_prefill, enable_prefix_caching=True,
                                     prefix_cache_state_budget=pool.state_budget, tp=tp)
    return Engine(path, config)


def soak_pool(path: str, pool: Pool, num_requests: int, rng: random.Random, figures: Figures,
              tp: int = 1) -> list[Request]:
    """Run `num_requests` through one cache-on engine (`tp` ranks); returns them all (finished or aborted)."""
    engine = make_engine(path, pool, tp)
    try:
        return _drive(engine, pool, num_requests, rng, figures)
    finally:
        engine.close()


def _drive(engine: Engine, pool: Pool, num_requests: int, rng: random.Random, figures: Figures) -> list[Request]:
    scheduler, trie = engine.scheduler, engine.scheduler.trie
    counts = figures.counts
    workload = Workload(rng, pool.max_tokens)
    live: dict[int, Request] = {}

    schedule, preempt = scheduler.schedule, scheduler.preempt

    def schedule_with_aborts():
        out = schedule()
        restored = {dst for _, dst in out.state_restores}
        for seq in list(out.seqs) + [seq for seq, _ in out.logits_hits]:
            request = live.get(seq.seq_id)
            if seq.state_slot in restored and request is not None and request.abort is None and rng.random() < 0.3:
                request.abort = 'restore'        # its restore copies are in this very forward
                engine.abort_request(seq.seq_id)
        counts['restores'] += len(out.state_restores)
        counts['logits_hits'] += len(out.logits_hits)
        return out

    def counted_preempt(seq):
        counts['preemptions'] += 1
        preempt(seq)

    scheduler.schedule, scheduler.preempt = schedule_with_aborts, counted_preempt
    submitted, steps = 0, 0
    while submitted < num_requests or engine.has_work:
        for _ in range(min(rng.choice([0, 0, 0, 1, 1, 3]), num_requests - submitted)):
            request = workload.next()
            request.seq_id = engine.add_request(request.prompt, SamplingParams(max_new_tokens=request.max_new_tokens),
                                                callback=request.on_output)
            live[request.seq_id] = request
            submitted += 1
            if rng.random() < 0.06:
                request.abort = 'submit'
                engine.abort_request(request.seq_id)
        for request in list(live.values()):
            if request.abort is None and request.tokens and not request.finished and rng.random() < 0.04:
                request.abort = 'mid'
                engine.abort_request(request.seq_id)
        engine.step()
        steps += 1
        engine.check_integrity()
        if trie.checkpoints is not None:
            assert all(ck.pin_count == 0 for ck in trie.checkpoints.live()), 'a restore pin outlived its step'
        for seq_id in [i for i, r in live.items() if r.finished]:
            del live[seq_id]
        assert steps < 40 * num_requests + 1000, 'the engine stopped making progress'
    check_pools_drain(engine)
    stats = engine.stats
    counts["steps"] += steps
    for reason, n in stats.get("miss_reasons", {}).items():
        counts[f"miss_{reason}"] += n
    counts['hits'] += stats['num_hits']
    counts['hit_tokens'] += stats['hit_tokens']
    counts['query_tokens'] += stats['query_tokens']
    counts['evicted_checkpoints'] += stats['evicted_checkpoints']
    counts['evicted_blocks'] += stats['evicted_blocks']
    for cause, n in stats['evictions_by_cause'].items():
        counts[f'evicted_checkpoints_{cause}'] += n
    return workload.history


def check_pools_drain(engine: Engine) -> None:
    """Idle engine: the cache owns whatever is not free; evicting it frees every block and slot."""
    scheduler = engine.scheduler
    assert not scheduler.running and not scheduler.waiting
    blocks, slots, trie = scheduler.block_manager, scheduler.state_manager, scheduler.trie
    trie_blocks, ck_slots = trie.owners()
    assert blocks.num_free + len(trie_blocks) == blocks.num_blocks, 'a KV block is held outside the cache'
    assert slots.num_free + len(ck_slots) == slots.num_usable, 'a state slot is held outside the cache'
    assert trie.evict_blocks(blocks.num_blocks), 'an idle cache could not be evicted'
    while trie.evict_slot():
        pass
    assert blocks.num_free == blocks.num_blocks and slots.num_free == slots.num_usable
    engine.check_integrity()


def control_outputs(path: str, requests: list[Request]) -> dict[tuple, tuple[list[int], torch.Tensor]]:
    """Greedy tokens and the top-2 logit gap of each generated position, per distinct prompt, cache off."""
    wanted: dict[tuple, int] = {}
    for r in requests:
        key = tuple(r.prompt)
        wanted[key] = max(wanted.get(key, 0), r.max_new_tokens)
    engine = make_engine(path, None)
    results = {}
    keys = list(wanted)
    for start in range(0, len(keys), 64):
        batch = []
        for key in keys[start:start + 64]:
            tokens: list[int] = []
            seq_id = engine.add_request(list(key), SamplingParams(max_new_tokens=wanted[key]),
                                        callback=lambda out, tokens=tokens: tokens.extend(out.new_token_ids),
                                        collect_logits=True)
            batch.append((key, seq_id, tokens))
        engine.run_until_idle()
        for key, seq_id, tokens in batch:
            logits = engine.pop_collected_logits(seq_id)[len(key) - 1:]
            top2 = logits.topk(2, dim=-1).values
            results[key] = (tokens, top2[:, 0] - top2[:, 1])
    return results


def compare(requests: list[Request], control: dict, figures: Figures) -> None:
    counts = figures.counts
    for r in requests:
        assert r.finished, f'request {r.seq_id} never finished'
        assert r.error is None, f'request {r.seq_id} failed: {r.error}'
        counts['requests'] += 1
        assert 0 <= r.num_cached <= len(r.prompt), (r.num_cached, len(r.prompt))
        if r.finish_reason == 'abort':
            counts[f'aborted_{r.abort}'] += 1
        else:
            assert r.finish_reason == 'length' and len(r.tokens) == r.max_new_tokens, (r.finish_reason, r.tokens)
            counts['completed'] += 1
        expected, gaps = control[tuple(r.prompt)]
        for i, token in enumerate(r.tokens):
            if token != expected[i]:
                assert gaps[i] < TIE_TOL, (f'request {r.seq_id} (prompt {len(r.prompt)} tokens, {r.num_cached} '
                                           f'cached) differs from the control at generated token {i}: {token} != '
                                           f'{expected[i]} (control top-2 gap {gaps[i]:.2e})')
                counts['near_ties'] += 1
                break


def soak(path: str, num_requests: int, seed: int = SEED, tp: int = 1) -> Figures:
    """The soak with the cache-on engines on `tp` ranks; the control is always the TP=1 cache-off engine."""
    figures = Figures()
    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only add overhead (and fight other processes)
    try:
        rng = random.Random(seed)
        requests = []
        for i, pool in enumerate(POOLS):
            share = num_requests // len(POOLS) + (i < num_requests % len(POOLS))
            requests += soak_pool(path, pool, share, rng, figures, tp)
        compare(requests, control_outputs(path, requests), figures)
    finally:
        torch.set_num_threads(threads)
    figures.seconds = time.perf_counter() - start
    counts = figures.counts
    if num_requests >= CI_REQUESTS:  # engagement guards: the soak must exercise what it claims to
        assert counts['hits'] > 0 and counts['logits_hits'] > 0, 'the cache never hit'
        assert counts['preemptions'] > 0 and counts['evicted_blocks'] > 0 and counts['evicted_checkpoints'] > 0, \
            'the pools were never under pressure'
        assert counts['aborted_restore'] > 0 and counts['aborted_mid'] > 0 and counts['aborted_submit'] > 0
    return figures


def test_soak(tiny_model_factory):
    figures = soak(tiny_model_factory('qwen3_5'), CI_REQUESTS)
    print(f'\nsoak ({CI_REQUESTS} requests, seed {SEED}): {figures.line()}')


@pytest.mark.slow
def test_soak_long(tiny_model_factory):
    num_requests = int(os.environ.get('LMDEPLOY_SOAK_REQUESTS', LONG_REQUESTS))
    figures = soak(tiny_model_factory('qwen3_5'), num_requests)
    print(f'\nsoak ({num_requests} requests, seed {SEED}): {figures.line()}')


# TP=2 (two processes, gloo): every output equals the TP=1 cache-off control, and no block or slot leaks. Each
# pool starts a worker, so the CI run is short; the full-size one is `slow`.
TP_CI_REQUESTS = 24


def test_soak_tp2_matches_the_tp1_control(tiny_model_factory):
    figures = soak(tiny_model_factory('qwen3_5', **TP_HYBRID), TP_CI_REQUESTS, tp=2)
    assert figures.counts['completed'] > 0
    print(f'\nsoak tp=2 ({TP_CI_REQUESTS} requests, seed {SEED}): {figures.line()}')


@pytest.mark.slow
def test_soak_tp2_full_size(tiny_model_factory):
    figures = soak(tiny_model_factory('qwen3_5', **TP_HYBRID), CI_REQUESTS, tp=2)
    print(f'\nsoak tp=2 ({CI_REQUESTS} requests, seed {SEED}): {figures.line()}')


def test_request_that_fits_is_served_after_a_partial_hit(tiny_model_factory):
    # 5 blocks of 16 tokens: session_len 80. The 40-token prompt leaves a partial checkpoint at 40 (frozen block);
    # the 79-token prompt extending it fits the pool cold (5 blocks) but not as a hit (2 shared + the pinned frozen
    # block + 3 new > 5). The cache-off engine serves both.
    path = tiny_model_factory('qwen3_5')
    first = [(7 * i) % VOCAB for i in range(40)]
    second = first + [(11 * i + 3) % VOCAB for i in range(39)]
    for cache in (False, True):
        engine = Engine(path, PytorchEngineConfig(device_type='cpu', block_size=BLOCK_SIZE, kernel_block_size=8,
                                                  num_gpu_blocks=5, max_batch_size=1, enable_prefix_caching=cache))
        requests = [Request(first, 1), Request(second, 1)]
        for request in requests:
            engine.add_request(request.prompt, SamplingParams(max_new_tokens=1), callback=request.on_output)
            for _ in range(20):
                if not engine.has_work:
                    break
                engine.step()
        assert [(r.finish_reason, r.error) for r in requests] == [('length', None)] * 2, f'cache={cache}'


def main() -> None:
    import tempfile

    from lmdeploy.demo_model import save_tiny_model
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--long', action='store_true', help=f'{LONG_REQUESTS} requests instead of {CI_REQUESTS}')
    parser.add_argument('--requests', type=int, default=None, help='number of requests (overrides --long)')
    parser.add_argument('--seed', type=int, default=SEED)
    parser.add_argument('--tp', type=int, default=1, help='tensor-parallel ranks of the cache-on engines')
    args = parser.parse_args()
    default = int(os.environ.get('LMDEPLOY_SOAK_REQUESTS', LONG_REQUESTS)) if args.long else CI_REQUESTS
    num_requests = args.requests or default
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_model(tmp, arch='qwen3_5', config_overrides=TP_HYBRID if args.tp > 1 else None)
        figures = soak(path, num_requests, args.seed, args.tp)
    print(f'soak ({num_requests} requests, seed {args.seed}): {figures.line()}')


if __name__ == '__main__':
    main()
