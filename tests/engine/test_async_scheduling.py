"""Async scheduling (`engine/async_scheduling.py`) against the synchronous loop as the reference, on tiny CPU models.

Both loops run the same requests; async scheduling must give the same tokens, finish reasons, cached tokens and
collected logits, with `check_integrity()` after every step and every block and slot back at the end. Stop tokens
are taken from the synchronous run's own output, so that requests really stop on them (one step late in the async
loop, which rolls the extra piece back). Engagement guards: steps really were launched with another in flight, and
late stops really were rolled back.
"""
from __future__ import annotations

import pytest
import torch
from engines import engine_factory
from numeric import assert_close

from lmdeploy.pytorch.messages import SamplingParams
from lmdeploy.pytorch.paging.scheduler import Scheduler

B = 16
make_engine = engine_factory(block_size=B, kernel_block_size=8, num_gpu_blocks=96, max_batch_size=8,
                             max_prefill_token_num=64)
ARCHS = ('qwen3', 'qwen3_5')


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 400, (n,), generator=g).tolist()


class Run:
    """Submit requests (optionally in waves, optionally aborting one after some tokens) and step to the end."""

    def __init__(self, engine):
        self.engine, self.outs, self.aborts = engine, {}, {}
        self.rolled_back = 0

    def add(self, tokens, params, collect=False, abort_after: int | None = None) -> int:
        rid = self.engine.add_request(tokens, params, self._callback, collect_logits=collect)
        self.outs[rid] = []
        if abort_after is not None:
            self.aborts[rid] = abort_after
        return rid

    def _callback(self, out) -> None:
        self.outs[out.seq_id].append(out)
        got = sum(len(o.new_token_ids) for o in self.outs[out.seq_id])
        if self.aborts.get(out.seq_id) is not None and got >= self.aborts[out.seq_id] and not out.finished:
            self.aborts[out.seq_id] = None
            self.engine.abort_request(out.seq_id)

    def finish(self) -> None:
        for _ in range(2000):
            if not self.engine.has_work:
                break
            self.engine.step()
            self.engine.check_integrity()
        assert not self.engine.has_work

    def result(self, rid: int):
        outs = self.outs[rid]
        return ([t for o in outs for t in o.new_token_ids], outs[-1].finish_reason, outs[-1].num_cached)


def count_rollbacks(monkeypatch) -> list[int]:
    calls = [0]
    original = Scheduler._roll_back_piece

    def counted(self, seq):
        calls[0] += 1
        return original(self, seq)
    monkeypatch.setattr(Scheduler, '_roll_back_piece', counted)
    return calls


def assert_all_free(engine) -> None:
    engine.check_integrity()
    blocks = engine.scheduler.block_manager
    owned, _ = engine.scheduler.prefix_cache.owners()
    assert blocks.num_free + len(set(owned)) == blocks.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting


def run_mix(engine, stop_ids: dict[int, tuple[int, ...]], abort: bool, stop_seq: tuple[int, ...] = ()):
    """Six concurrent requests of mixed lengths (one chunked: its prompt exceeds the 64-token prefill budget), then
    a second wave while the first decodes; stops by length, by stop token (with min_new_tokens), by a stop sequence
    (with logprobs: both keep their steps synchronous), seeded sampling, one request collecting logits, one aborted
    mid-decode."""
    run = Run(engine)
    ids = []
    for i in range(6):
        params = SamplingParams(max_new_tokens=6 + 5 * i, stop_token_ids=stop_ids.get(i, ()),
                                min_new_tokens=2 if i == 3 else 0,
                                temperature=0.8 if i == 4 else 0.0, top_k=20, random_seed=7 + i if i == 4 else None)
        ids.append(run.add(prompt(9 + 23 * i, i), params, collect=i == 0, abort_after=4 if abort and i == 5 else None))
    for _ in range(3):
        engine.step()
        engine.check_integrity()
    for i in range(6, 9):
        params = SamplingParams(max_new_tokens=9, stop_token_ids=stop_ids.get(i, ()))
        ids.append(run.add(prompt(30 + 11 * i, i), params))
    params = SamplingParams(max_new_tokens=7, stop_sequences=(stop_seq,) if stop_seq else (), logprobs=2)
    ids.append(run.add(prompt(20, 9), params))
    run.finish()
    logits = {rid: engine.pop_collected_logits(rid) for rid in ids if rid in engine._collected_logits}
    return [run.result(rid) for rid in ids], logits


@pytest.mark.parametrize('arch', ARCHS)
@pytest.mark.parametrize('cache', [False, True], ids=['cache_off', 'cache_on'])
def test_async_scheduling_gives_the_synchronous_tokens(model_path, arch, cache, monkeypatch):
    path = model_path(arch)
    reference, ref_logits = run_mix(make_engine(path, cache=cache, async_scheduling=False), {}, abort=True)
    # stop ids from the reference's own output, so that five requests really stop on a token mid-reply
    stop_ids = {i: (reference[i][0][k],) for i, k in ((0, 2), (1, 4), (3, 1), (6, 3), (7, 5))}
    stop_seq = tuple(reference[9][0][2:4])
    sync_engine = make_engine(path, cache=cache, async_scheduling=False)
    expected, expected_logits = run_mix(sync_engine, stop_ids, abort=True, stop_seq=stop_seq)
    assert sum(reason == 'stop' for _, reason, _ in expected) >= 5 and expected[9][1] == 'stop'
    rollbacks = count_rollbacks(monkeypatch)
    engine = make_engine(path, cache=cache, async_scheduling=True)
    got, got_logits = run_mix(engine, stop_ids, abort=True, stop_seq=stop_seq)
    assert got == expected
    assert got_logits.keys() == expected_logits.keys()
    for rid in got_logits:
        assert_close(got_logits[rid], expected_logits[rid], atol=1e-5, rtol=0)
    assert engine.num_overlapped_steps >= 5
    # With prefix caching on, prefill steps reserve checkpoints and settle at once, so whether a token stop lands in
    # an overlapped step depends on the arrivals; the reply-checkpoint test below forces one.
    assert rollbacks[0] >= 1 or cache
    assert_all_free(engine)
    assert_all_free(sync_engine)


@pytest.mark.parametrize('arch', ARCHS)
def test_reply_checkpoint_after_a_late_stop_matches_the_synchronous_one(model_path, arch, monkeypatch):
    """Turn 1 stops on a stop token (seen one step late under async scheduling); turn 2 resends prompt + reply and
    resumes from turn 1's reply checkpoint. Same cached tokens and the same logits as the synchronous loop: the
    checkpoint holds the state after the reply, not after the discarded extra token."""
    path = model_path(arch)
    first = prompt(37, 1)

    def turns(engine, stop: tuple[int, ...]):
        run = Run(engine)
        rid = run.add(first, SamplingParams(max_new_tokens=20, stop_token_ids=stop))
        run.finish()
        reply, reason, _ = run.result(rid)
        second = first + reply + list(stop[:1] if reason == 'stop' else ()) + prompt(9, 2)
        rid2 = run.add(second, SamplingParams(max_new_tokens=6), collect=True)
        run.finish()
        return reply, reason, run.result(rid2), engine.pop_collected_logits(rid2)

    probe = turns(make_engine(path, cache=True, async_scheduling=False), ())
    stop = (probe[0][7],)
    sync = turns(make_engine(path, cache=True, async_scheduling=False), stop)
    rollbacks = count_rollbacks(monkeypatch)
    engine = make_engine(path, cache=True, async_scheduling=True)
    got = turns(engine, stop)
    assert rollbacks[0] == 1  # turn 1's stop was seen one step late
    assert sync[1] == 'stop' and got[:3] == sync[:3]
    assert got[2][2] > 0  # the second turn hit the cache
    assert_close(got[3], sync[3], atol=1e-5, rtol=0)
    assert_all_free(engine)


def test_session_len_and_length_stops_are_never_scheduled_past(model_path):
    path = model_path('qwen3_5')

    def go(async_scheduling: bool):
        engine = make_engine(path, session_len=60, async_scheduling=async_scheduling)
        run = Run(engine)
        ids = [run.add(prompt(50, 3), SamplingParams(max_new_tokens=40)),
               run.add(prompt(20, 4), SamplingParams(max_new_tokens=1)),
               run.add(prompt(20, 5), SamplingParams(max_new_tokens=3))]
        run.finish()
        assert_all_free(engine)
        return [run.result(rid) for rid in ids]

    expected = go(False)
    assert [r[1] for r in expected] == ['length'] * 3 and len(expected[0][0]) == 10
    assert go(True) == expected


def test_async_scheduling_defaults(model_path):
    path = model_path('qwen3')
    assert make_engine(path).async_scheduling is False  # CPU: off unless asked
    with pytest.raises(ValueError, match='async_scheduling'):
        make_engine(path, async_scheduling=True, enable_prefix_caching=True, prefix_cache_decode_state_interval=B)


@pytest.mark.gpu
@pytest.mark.parametrize('arch', ARCHS)
@pytest.mark.parametrize('cache', [False, True], ids=['cache_off', 'cache_on'])
def test_cuda_async_scheduling_gives_the_synchronous_tokens(model_path, arch, cache):
    """On the GPU (CUDA graphs, streams, pinned copies): async scheduling (the CUDA default) against the
    synchronous loop; greedy tokens equal (both run the same kernels in the same batches but one step late)."""
    path = model_path(arch)
    cuda = engine_factory(device_type='cuda', dtype='float32', block_size=B, num_gpu_blocks=96, max_batch_size=8,
                          max_prefill_token_num=64)
    reference, _ = run_mix(cuda(path, cache=cache, async_scheduling=False), {}, abort=True)
    stop_ids = {i: (reference[i][0][k],) for i, k in ((0, 2), (1, 4), (3, 1), (6, 3), (7, 5))}
    stop_seq = tuple(reference[9][0][2:4])
    sync_engine = cuda(path, cache=cache, async_scheduling=False)
    expected, expected_logits = run_mix(sync_engine, stop_ids, abort=True, stop_seq=stop_seq)
    engine = cuda(path, cache=cache)
    assert engine.async_scheduling
    got, got_logits = run_mix(engine, stop_ids, abort=True, stop_seq=stop_seq)
    assert [g[1:] for g in got] == [e[1:] for e in expected]
    assert [g[0] for g in got] == [e[0] for e in expected]
    for rid in got_logits:
        assert_close(got_logits[rid], expected_logits[rid], atol=1e-3, rtol=0)
    assert engine.num_overlapped_steps >= 5
    assert_all_free(engine)
