"""Tensor parallelism on two GPUs (NCCL, CUDA graphs on): TP=2 against TP=1 on the same GPUs, as the CPU module
(`test_tensor_parallel.py`) does with gloo. Skipped without two CUDA devices.

float32 runs compare tightly (decode batches replay CUDA graphs with the NCCL all-reduce captured inside them);
a bf16 run compares within bf16 tolerance; the prefix-cache hit at a non-aligned step under TP=2 equals cold; a
killed worker fails the request with its rank instead of hanging (NCCL: the monitor aborts the group)."""
from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch
from tp_models import BLOCK, HYBRID, MODELS

from lmdeploy import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.messages import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason='needs two CUDA devices')]



def make(path: str, tp: int, dtype: str = 'float32', **overrides) -> Engine:
    config = dict(device_type='cuda', tp=tp, dtype=dtype, block_size=BLOCK, num_gpu_blocks=64, max_batch_size=4,
                  max_prefill_token_num=64)
    return Engine(path, PytorchEngineConfig(**{**config, **overrides}))


def run(engine: Engine, prompts: list[list[int]], max_new_tokens: int = 6):
    results = []
    for prompt in prompts:
        tokens: list[int] = []
        seq_id = engine.add_request(prompt, SamplingParams(max_new_tokens=max_new_tokens),
                                    callback=lambda out, tokens=tokens: tokens.extend(out.new_token_ids),
                                    collect_logits=True)
        results.append((seq_id, tokens))
    engine.run_until_idle()
    return [(tokens, engine.pop_collected_logits(seq_id).float()) for seq_id, tokens in results]


def prompts_of(seed: int, lengths=(90, 21)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1000, (n,), generator=g).tolist() for n in lengths]


def closed(engine: Engine):
    engine.close()
    assert not [p for p in multiprocessing.active_children() if p.name.startswith('lmdeploy-tp')]


@pytest.mark.parametrize('case', list(MODELS))
def test_tp2_matches_tp1_on_two_gpus_float32(tiny_model_factory, case):
    arch, overrides = MODELS[case]
    path = tiny_model_factory(arch, **overrides)
    reference = run(make(path, 1), prompts_of(1))
    engine = make(path, 2)
    try:
        assert engine.agent.local.graph_runner is not None, 'CUDA graphs are off under TP'
        got = run(engine, prompts_of(1))
        engine.check_integrity()
    finally:
        closed(engine)
    for (ref_tokens, ref_logits), (tokens, logits) in zip(reference, got):
        assert tokens == ref_tokens
        torch.testing.assert_close(logits, ref_logits, rtol=1e-3, atol=1e-3)


def test_tp2_matches_tp1_on_two_gpus_bf16(tiny_model_factory):
    path = tiny_model_factory('qwen3_5', **HYBRID)
    reference = run(make(path, 1, 'bfloat16'), prompts_of(2), max_new_tokens=1)
    engine = make(path, 2, 'bfloat16')
    try:
        got = run(engine, prompts_of(2), max_new_tokens=1)
    finally:
        closed(engine)
    for (_, ref_logits), (_, logits) in zip(reference, got):
        err = (logits - ref_logits).abs().max().item()
        assert err < 0.05 * ref_logits.abs().max().item() + 1e-2, err


def test_tp2_prefix_hit_at_a_non_aligned_step_equals_cold_on_two_gpus(tiny_model_factory):
    path = tiny_model_factory('qwen3_5', **HYBRID)
    first = prompts_of(3, lengths=(37,))[0]
    second = first + prompts_of(4, lengths=(11,))[0]
    cold = run(make(path, 1), [second])[0]
    engine = make(path, 2, enable_prefix_caching=True)
    try:
        run(engine, [first], max_new_tokens=1)
        cached, tokens = [], []
        seq_id = engine.add_request(second, SamplingParams(max_new_tokens=6), collect_logits=True,
                                    callback=lambda out: (tokens.extend(out.new_token_ids),
                                                          cached.append(out.num_cached)))
        engine.run_until_idle()
        logits = engine.pop_collected_logits(seq_id).float()
    finally:
        closed(engine)
    hit = cached[-1]
    assert hit % BLOCK and 0 < hit < len(second), hit
    assert tokens == cold[0]
    torch.testing.assert_close(logits, cold[1][hit:], rtol=1e-3, atol=1e-3)


def test_a_killed_worker_fails_the_request_on_nccl_instead_of_hanging(tiny_model_factory):
    path = tiny_model_factory('qwen3', **MODELS['qwen3_gqa'][1])
    engine = make(path, 2)
    try:
        outs = []
        engine.add_request(prompts_of(5)[0], SamplingParams(max_new_tokens=200), callback=outs.append)
        engine.step()
        os.kill(engine.tp_workers.workers[0].process.pid, signal.SIGKILL)
        start = time.monotonic()
        while not (outs and outs[-1].finished):
            assert time.monotonic() - start < 60, 'the engine hung on a dead worker'
            engine.step()
        assert outs[-1].finish_reason == 'error' and 'rank 1' in outs[-1].error, outs[-1].error
    finally:
        closed(engine)
