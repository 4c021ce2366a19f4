"""A fault while scheduling fails requests instead of stalling the engine.

Before, an exception raised inside `Scheduler.schedule()` (seen: an integer overflow while hashing a request's
prefix) left the request queued; every later step raised again and the request hung with no error delivered. Now a
prefix-cache match that raises fails that request alone, and any other scheduling fault fails what that call had
admitted or scheduled plus the request it was admitting; pins and reservations are dropped, nothing leaks, and the
engine keeps serving. Geometry: tiny Qwen3.5 (hybrid), block_size 16, prefix caching on.
"""
from __future__ import annotations

import pytest
import torch
from engines import engine_factory

from lmdeploy.pytorch.messages import SamplingParams

make_engine = engine_factory(block_size=16, kernel_block_size=8, num_gpu_blocks=64, max_batch_size=8,
                             max_prefill_token_num=512, enable_prefix_caching=True)


def ids(length: int, seed: int) -> list[int]:
    return torch.randint(0, 1000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


class Collected:
    def __init__(self):
        self.tokens: list[int] = []
        self.finish_reason = None
        self.error = None

    def __call__(self, out):
        self.tokens += out.new_token_ids
        if out.finished:
            self.finish_reason, self.error = out.finish_reason, out.error


def run(engine, prompts: list[list[int]], max_new_tokens: int = 4) -> list[Collected]:
    outs = [Collected() for _ in prompts]
    for p, out in zip(prompts, outs):
        engine.add_request(p, SamplingParams(max_new_tokens=max_new_tokens), callback=out)
    for _ in range(200):
        if not engine.has_work:
            break
        engine.step()
        engine.check_integrity()
    assert not engine.has_work, 'the engine did not drain: a request hangs'
    return outs


@pytest.fixture(scope='module')
def hybrid_path(tiny_model_factory):
    return tiny_model_factory('qwen3_5')


def test_a_match_that_raises_fails_its_own_request_only(hybrid_path, monkeypatch):
    engine = make_engine(hybrid_path)
    bad, good = ids(40, seed=1), ids(40, seed=2)
    reference = run(make_engine(hybrid_path), [good])[0].tokens
    cache = engine.scheduler.prefix_cache
    real_match = cache.match

    def match(seq, **kwargs):
        if seq.token_ids[:40] == bad:
            raise OverflowError('hash overflow')
        return real_match(seq, **kwargs)

    monkeypatch.setattr(cache, 'match', match)
    out_bad, out_good = run(engine, [bad, good])
    assert out_bad.finish_reason == 'error' and 'hash overflow' in out_bad.error and out_bad.tokens == []
    assert out_good.finish_reason == 'length' and out_good.error is None and out_good.tokens == reference


def test_a_scheduling_fault_fails_that_batch_and_the_engine_keeps_serving(hybrid_path, monkeypatch):
    engine = make_engine(hybrid_path)
    first, later = ids(40, seed=3), ids(40, seed=4)
    reference = run(make_engine(hybrid_path), [later])[0].tokens
    cache = engine.scheduler.prefix_cache
    real_plan = cache.plan_checkpoints
    calls = {'n': 0}

    def plan_checkpoints(out):
        calls['n'] += 1
        if calls['n'] == 1:  # the first schedule() call faults after admitting `first` (pins, blocks, slot held)
            raise RuntimeError('planner bug')
        return real_plan(out)

    monkeypatch.setattr(cache, 'plan_checkpoints', plan_checkpoints)
    (out_first,) = run(engine, [first])
    assert out_first.finish_reason == 'error' and 'planner bug' in out_first.error
    (out_later,) = run(engine, [later])  # the engine serves on, from a clean state (check_integrity ran each step)
    assert out_later.finish_reason == 'length' and out_later.tokens == reference
    assert not engine.scheduler.running and not engine.scheduler.waiting
