"""Tensor parallelism on the CPU: real two-process runs (rank 0 in the test process, rank 1 a spawned worker, gloo
between them) against the same engine at TP=1, which is the reference (itself tested against transformers).

The models have n_v / n_k = 3 (gated delta) so a rank's q, k, v sections differ from a plain chunk of the fused
rows, and Qwen3 runs with grouped KV heads (2 over 2 ranks) and with one KV head replicated on both ranks. Each
TP=2 engine costs a worker start (a few seconds): the module keeps them few and closes every one."""
from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch
from tp_models import BLOCK, HYBRID, MODELS, random_prompts, rank_slice_of_state, run_batched

from lmdeploy import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.messages import SamplingParams
from lmdeploy.pytorch.nn.parallel import reduction_points

RTOL, ATOL = 1e-4, 1e-4   # float32 (as against transformers); TP=2 only reorders the row-parallel sums


def make(path: str, tp: int, **overrides) -> Engine:
    config = dict(device_type='cpu', tp=tp, block_size=BLOCK, kernel_block_size=8, num_gpu_blocks=48,
                  max_batch_size=4, max_prefill_token_num=32)
    return Engine(path, PytorchEngineConfig(**{**config, **overrides}))


run = functools.partial(run_batched, max_new_tokens=4)
prompts_of = functools.partial(random_prompts, lengths=(45, 21))


@pytest.fixture
def no_leftover_workers():
    yield
    children = [p for p in multiprocessing.active_children() if p.name.startswith('lmdeploy-tp')]
    assert not children, f'tensor-parallel workers outlived their engine: {children}'


@pytest.mark.parametrize('case', list(MODELS))
def test_tp2_logits_equal_tp1_under_teacher_forcing(tiny_model_factory, case, no_leftover_workers):
    """Two prompts batched, prefilled in 32-token chunks, then decoded: every fed token's logits agree."""
    arch, overrides = MODELS[case]
    path = tiny_model_factory(arch, **overrides)
    prompts = prompts_of(1)
    reference = run(make(path, 1), prompts)
    engine = make(path, 2)
    try:
        got = run(engine, prompts)
        engine.check_integrity()
    finally:
        engine.close()
    for (ref_tokens, ref_logits), (tokens, logits) in zip(reference, got):
        assert tokens == ref_tokens
        assert logits.shape == ref_logits.shape and logits.shape[0] > 0
        torch.testing.assert_close(logits, ref_logits, rtol=RTOL, atol=ATOL)


def test_tp2_prefix_hit_at_a_non_aligned_step_equals_cold_and_restores_each_ranks_head_slice(
        tiny_model_factory, no_leftover_workers):
    from lmdeploy.pytorch.models.loader import load_hf_config
    path = tiny_model_factory('qwen3_5', **HYBRID)
    first = prompts_of(2, lengths=(37,))[0]          # its end checkpoint sits at step 37 (not a block multiple)
    second = first + prompts_of(3, lengths=(11,))[0]
    cold = run(make(path, 1), [second])[0]
    tp1 = make(path, 1, enable_prefix_caching=True)
    run(tp1, [first], max_new_tokens=1)
    engine = make(path, 2, enable_prefix_caching=True)
    try:
        run(engine, [first], max_new_tokens=1)
        tokens: list[int] = []
        cached = []
        seq_id = engine.add_request(second, SamplingParams(max_new_tokens=4),
                                    callback=lambda out: (tokens.extend(out.new_token_ids),
                                                          cached.append(out.num_cached)),
                                    collect_logits=True)
        engine.run_until_idle()
        hit_logits = engine.pop_collected_logits(seq_id)
        run(tp1, [second])
        ranks = engine.agent.rank_state_caches()
        engine.check_integrity()
    finally:
        engine.close()
    hit = cached[-1]
    assert hit % BLOCK and 0 < hit < len(second), f'expected a hit at a non-aligned step, got {hit}'
    assert tokens == cold[0]
    torch.testing.assert_close(hit_logits, cold[1][hit:], rtol=RTOL, atol=ATOL)
    # Both engines made the same scheduling decisions: every state row (checkpoints, the restored runtime rows)
    # of each rank is the TP=1 row's head slice.
    text = load_hf_config(path)
    tp1_state = tp1.cache_engine.state_caches
    assert len(ranks) == 2 and len(ranks[0]) == len(tp1_state) > 0
    for rank, layers in enumerate(ranks):
        for full, mine in zip(tp1_state, layers):
            want = rank_slice_of_state(full, text, rank, 2)
            assert mine['conv'].abs().sum() > 0
            torch.testing.assert_close(mine['conv'], want['conv'], rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(mine['recurrent'], want['recurrent'], rtol=RTOL, atol=ATOL)


def test_a_killed_worker_fails_every_request_clearly_and_stops_the_engine(tiny_model_factory, no_leftover_workers):
    path = tiny_model_factory('qwen3', **MODELS['qwen3_gqa'][1])
    engine = make(path, 2)
    try:
        outs = []
        engine.add_request(prompts_of(4)[0], SamplingParams(max_new_tokens=50), callback=outs.append)
        engine.step()
        engine.step()
        worker = engine.tp_workers.workers[0].process
        os.kill(worker.pid, signal.SIGKILL)
        start = time.monotonic()
        while not (outs and outs[-1].finished):
            assert time.monotonic() - start < 30, 'the engine hung on a dead worker'
            engine.step()
        error = outs[-1].error
        assert outs[-1].finish_reason == 'error' and 'rank 1' in error and 'exited with code -9' in error, error
        assert engine.fatal_error is not None and not engine.has_work
        with pytest.raises(RuntimeError, match='the engine has stopped: tensor-parallel worker rank 1'):
            engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=1))
    finally:
        engine.close()
    assert worker.exitcode == -signal.SIGKILL
    import torch.distributed as dist
    assert not dist.is_initialized(), 'the broken group was not left: no later TP engine could start here'


def test_a_dead_worker_reads_the_same_exit_code_from_every_thread(monkeypatch):
    """The monitor thread and a failed step describe a dead worker at the same time (the race behind a killed-worker
    failure reading 'exited with code None'): the reaping is serialized, so both read its exit code. A `waitpid`
    that stalls after reaping, as a descheduled thread does under load, makes the race certain here."""
    from multiprocessing.connection import wait

    from lmdeploy.pytorch.engine.tp_workers import _Worker
    ctx = multiprocessing.get_context('fork')
    process = ctx.Process(target=time.sleep, args=(60,), daemon=True)
    process.start()
    reports, _ = ctx.Pipe(duplex=False)
    worker = _Worker(1, process, None, reports)
    os.kill(process.pid, signal.SIGKILL)
    wait([process.sentinel])
    real_waitpid = os.waitpid

    def stalling_waitpid(pid, options):
        result = real_waitpid(pid, options)
        if result[0] == pid:
            time.sleep(0.3)   # reaped, exit code not yet stored on the `Process`
        return result
    monkeypatch.setattr(os, 'waitpid', stalling_waitpid)
    descriptions = []
    threads = [threading.Thread(target=lambda: descriptions.append(worker.describe_exit())) for _ in range(2)]
    threads[0].start()
    time.sleep(0.1)
    threads[1].start()
    for thread in threads:
        thread.join()
    want = f'tensor-parallel worker rank 1 (pid {process.pid}) exited with code -9'
    assert descriptions == [want, want]


def test_ctrl_c_reaching_the_workers_does_not_stop_the_engine(tiny_model_factory, no_leftover_workers):
    """A terminal's Ctrl-C goes to every process of the group (`lmdeploy chat` uses it to stop a reply)."""
    from lmdeploy.pytorch.engine.tp_dist import MULTICAST_OFF
    path = tiny_model_factory('qwen3', **MODELS['qwen3_gqa'][1])
    engine = make(path, 2)
    try:
        pid = engine.tp_workers.workers[0].process.pid
        with open(f'/proc/{pid}/environ', 'rb') as f:  # NVLink multicast off in the worker too
            env = dict(item.decode().split('=', 1) for item in f.read().split(b'\0') if b'=' in item)
        assert {k: env.get(k) for k in MULTICAST_OFF} == MULTICAST_OFF
        os.kill(pid, signal.SIGINT)
        time.sleep(0.5)
        (tokens, _), = run(engine, prompts_of(6)[:1])
        assert len(tokens) == 4 and engine.fatal_error is None
    finally:
        engine.close()


def test_a_worker_dying_while_idle_stops_the_loop_and_refuses_new_requests(tiny_model_factory, no_leftover_workers):
    from lmdeploy.pytorch.engine.engine_loop import EngineLoop
    path = tiny_model_factory('qwen3', **MODELS['qwen3_gqa'][1])
    engine = make(path, 2)
    loop = EngineLoop(engine)
    try:
        os.kill(engine.tp_workers.workers[0].process.pid, signal.SIGKILL)
        start = time.monotonic()
        while loop.is_alive:
            assert time.monotonic() - start < 30, 'the loop kept running on a dead worker'
            time.sleep(0.05)
        with pytest.raises(RuntimeError, match=r'tensor-parallel worker rank 1 \(pid \d+\) exited with code -9'):
            engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=1))
    finally:
        loop.close()


@pytest.mark.parametrize('arch', ['qwen3', 'qwen3_5'])
def test_tp1_is_the_single_device_path_no_worker_no_group_no_collective(tiny_model_factory, monkeypatch, arch):
    """TP=1 runs the code it ran before tensor parallelism existed, so its decode and prefill numbers are the plain
    path's: building and serving (chunked prefill, decode, a prefix hit) never reach a TP entry point (each refuses
    here), no process starts, no process group exists, and every reduction point is an identity."""
    import torch.distributed as dist

    from lmdeploy.pytorch.engine import agent_setup, tp_dist
    from lmdeploy.pytorch.engine.model_agent import ModelAgent

    def refuse(name: str):
        def called(*args, **kwargs):
            raise AssertionError(f'tp=1 reached {name}')
        return called
    for owner, name in ((agent_setup.TPWorkers, 'start'), (agent_setup, 'build_rank_model'),
                        (agent_setup, 'attach_tp_group'), (agent_setup, 'TPModelAgent'), (tp_dist, 'init_rank'),
                        (dist, 'init_process_group'), (dist, 'all_reduce')):
        monkeypatch.setattr(owner, name, refuse(name))
    before = set(multiprocessing.active_children())
    engine = make(tiny_model_factory(arch, **HYBRID if arch == 'qwen3_5' else {}), 1, enable_prefix_caching=True)
    prompt = prompts_of(7, lengths=(45,))[0]
    (tokens, logits), = run(engine, [prompt])
    (hit_tokens, _), = run(engine, [prompt + tokens])
    engine.check_integrity()
    assert len(tokens) == 4 and len(hit_tokens) == 4 and logits.shape[0] == 45 + 3
    assert engine.stats_snapshot.prefix_cache.hit_tokens >= BLOCK
    assert engine.tp_workers is None and set(multiprocessing.active_children()) == before
    assert not dist.is_initialized()
    reductions = reduction_points(engine.model)
    assert reductions and all(m.group is None for m in reductions)
    assert type(engine.agent) is ModelAgent


def test_pipeline_at_tp2_answers_like_tp1_and_its_close_joins_the_worker(tiny_model_factory, no_leftover_workers):
    """The user surface (pipeline -> engine loop thread -> TP engine): same greedy replies, and `close` (the
    context manager's exit) leaves no worker behind."""
    from lmdeploy import GenerationConfig, pipeline
    path = tiny_model_factory('qwen3', **MODELS['qwen3_gqa'][1])
    greedy = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    prompts = ['Hello there', 'How are you?']
    replies = {}
    for tp in (1, 2):
        config = PytorchEngineConfig(device_type='cpu', tp=tp, block_size=BLOCK, kernel_block_size=8,
                                     num_gpu_blocks=32, session_len=128)
        with pipeline(path, config) as pipe:
            replies[tp] = [(r.text, r.generate_token_len, r.finish_reason) for r in pipe(prompts, greedy)]
    assert replies[2] == replies[1] and all(n == 8 for _, n, _ in replies[1])


def test_workers_exit_when_the_engine_process_is_killed(tiny_model_factory):
    """SIGKILL leaves no clean-up to the engine process: its workers see their command pipe close and exit."""
    import subprocess
    import sys
    path = tiny_model_factory('qwen3', **MODELS['qwen3_gqa'][1])
    script = ('import sys, time\n'
              'from lmdeploy import PytorchEngineConfig\n'
              'from lmdeploy.pytorch.engine.engine import Engine\n'
              'if __name__ == "__main__":\n'
              f'    e = Engine({path!r}, PytorchEngineConfig(device_type="cpu", tp=2, num_gpu_blocks=16))\n'
              '    print(e.tp_workers.workers[0].process.pid, flush=True)\n'
              '    time.sleep(120)\n')
    proc = subprocess.Popen([sys.executable, '-c', script], stdout=subprocess.PIPE, text=True)
    try:
        worker_pid = int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()
    start = time.monotonic()
    while time.monotonic() - start < 30:
        try:
            with open(f'/proc/{worker_pid}/stat') as f:  # 'Z': exited, not yet reaped by init
                if f.read().rsplit(')', 1)[1].split()[0] == 'Z':
                    return
        except FileNotFoundError:
            return
        time.sleep(0.1)
    os.kill(worker_pid, signal.SIGKILL)
    raise AssertionError('a worker outlived its killed engine process')
