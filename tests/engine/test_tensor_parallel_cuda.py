"""Tensor parallelism on two GPUs (NCCL, CUDA graphs on): TP=2 against TP=1 on the same GPUs, as the CPU module
(`test_tensor_parallel.py`) does with gloo. Skipped without two CUDA devices.

float32 runs compare tightly (decode batches replay CUDA graphs with the NCCL all-reduce captured inside them);
a bf16 run compares within bf16 tolerance, on a tiny model and at Qwen3.5-9B's real depth (dummy weights); the
prefix-cache hit at a non-aligned step under TP=2 equals cold and restores each rank's head slice of the TP=1 state;
every worker runs with NVLink multicast off; a killed worker fails the request with its rank instead of hanging
(NCCL: the monitor aborts the group), which leaves the process group (it runs last: a later TP engine needs that)."""
from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import time

import pytest
import torch
from tp_models import BLOCK, HYBRID, MODELS, random_prompts, rank_slice_of_state, run_batched

from lmdeploy import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.engine.tp_dist import MULTICAST_OFF
from lmdeploy.pytorch.messages import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason='needs two CUDA devices')]



def make(path: str, tp: int, dtype: str = 'float32', **overrides) -> Engine:
    config = dict(device_type='cuda', tp=tp, dtype=dtype, block_size=BLOCK, num_gpu_blocks=64, max_batch_size=4,
                  max_prefill_token_num=64)
    return Engine(path, PytorchEngineConfig(**{**config, **overrides}))


run = functools.partial(run_batched, max_new_tokens=6)
prompts_of = functools.partial(random_prompts, lengths=(90, 21))


def closed(engine: Engine):
    engine.close()
    assert not [p for p in multiprocessing.active_children() if p.name.startswith('lmdeploy-tp')]


def environment_of(pid: int) -> dict[str, str]:
    with open(f'/proc/{pid}/environ', 'rb') as f:
        return dict(item.decode().split('=', 1) for item in f.read().split(b'\0') if b'=' in item)


@pytest.mark.parametrize('case', list(MODELS))
def test_tp2_matches_tp1_on_two_gpus_float32(tiny_model_factory, case):
    arch, overrides = MODELS[case]
    path = tiny_model_factory(arch, **overrides)
    reference = run(make(path, 1), prompts_of(1))
    engine = make(path, 2)
    try:
        assert engine.agent.local.graph_runner is not None, 'CUDA graphs are off under TP'
        env = environment_of(engine.tp_workers.workers[0].process.pid)
        assert {k: env.get(k) for k in MULTICAST_OFF} == MULTICAST_OFF == {k: os.environ.get(k) for k in MULTICAST_OFF}
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


def rms_ratio(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt()).item()


def test_tp2_matches_tp1_at_real_depth_in_bf16(tmp_path):
    """Qwen3.5-9B's shape (transformers' `Qwen3_5TextConfig()`: 32 layers, hidden 4096, n_v / n_k = 2) with dummy
    bf16 weights (the TP=2 dummy model is the TP=1 one, split): a 300-token prompt prefilled in 128-token chunks,
    then decode steps (CUDA graphs) while both runs agree on the tokens. bf16 reduction order differs (two partial
    sums all-reduced in bf16 per layer instead of one accumulation), so the bound is on the RMS error ratio of the
    fed tokens' logits."""
    import gc

    import transformers
    config = transformers.Qwen3_5TextConfig(max_position_embeddings=4096)
    config.architectures = ['Qwen3_5ForCausalLM']
    config.save_pretrained(tmp_path)
    overrides = dict(load_format='dummy', block_size=64, num_gpu_blocks=16, max_batch_size=2,
                     max_prefill_token_num=128, session_len=1024)
    prompt = prompts_of(6, lengths=(300,))[0]
    engine = make(str(tmp_path), 1, 'bfloat16', **overrides)
    (ref_tokens, ref_logits), = run(engine, [prompt], max_new_tokens=4)
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    engine = make(str(tmp_path), 2, 'bfloat16', **overrides)
    try:
        got = run(engine, [prompt[:]], max_new_tokens=4)
    finally:
        closed(engine)
    (tokens, logits), = got
    assert logits.shape == ref_logits.shape == (300 + 3, config.vocab_size)
    # A decode row is comparable while both runs fed the same tokens (greedy may part at a bf16 near-tie of random
    # weights): the prompt's 300 rows always, then one row per leading agreeing token.
    same = next((i for i, (a, b) in enumerate(zip(tokens[:3], ref_tokens[:3])) if a != b), 3)
    rows = 300 + same
    ratio = rms_ratio(logits[:rows], ref_logits[:rows])
    assert ratio < 0.05, f'TP=2 vs TP=1 at real depth: RMS error ratio {ratio:.3e} over {rows} rows'


def test_tp2_prefix_hit_at_a_non_aligned_step_equals_cold_and_restores_each_ranks_head_slice_on_two_gpus(
        tiny_model_factory):
    """As the gloo test: the hit equals cold, and every state row of each rank (checkpoints and the restored runtime
    rows) is the TP=1 engine's row cut to that rank's heads, the two engines having made the same decisions."""
    from lmdeploy.pytorch.models.loader import load_hf_config
    path = tiny_model_factory('qwen3_5', **HYBRID)
    first = prompts_of(3, lengths=(37,))[0]
    second = first + prompts_of(4, lengths=(11,))[0]
    cold = run(make(path, 1), [second])[0]
    tp1 = make(path, 1, enable_prefix_caching=True)
    run(tp1, [first], max_new_tokens=1)
    run(tp1, [second])
    engine = make(path, 2, enable_prefix_caching=True)
    try:
        run(engine, [first], max_new_tokens=1)
        cached, tokens = [], []
        seq_id = engine.add_request(second, SamplingParams(max_new_tokens=6), collect_logits=True,
                                    callback=lambda out: (tokens.extend(out.new_token_ids),
                                                          cached.append(out.num_cached)))
        engine.run_until_idle()
        logits = engine.pop_collected_logits(seq_id).float()
        ranks = engine.agent.rank_state_caches()
        engine.check_integrity()
    finally:
        closed(engine)
    hit = cached[-1]
    assert hit % BLOCK and 0 < hit < len(second), hit
    assert tokens == cold[0]
    torch.testing.assert_close(logits, cold[1][hit:], rtol=1e-3, atol=1e-3)
    text = load_hf_config(path)
    tp1_state = tp1.cache_engine.state_caches
    assert len(ranks) == 2 and len(ranks[0]) == len(tp1_state) > 0
    for rank, layers in enumerate(ranks):
        for full, mine in zip(tp1_state, layers):
            want = rank_slice_of_state({k: v.cpu() for k, v in full.items()}, text, rank, 2)
            assert mine['conv'].abs().sum() > 0
            torch.testing.assert_close(mine['conv'].cpu(), want['conv'], rtol=1e-3, atol=1e-3)
            torch.testing.assert_close(mine['recurrent'].cpu(), want['recurrent'], rtol=1e-3, atol=1e-3)


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
        assert 'exited with code -9' in outs[-1].error, outs[-1].error
    finally:
        closed(engine)
    import torch.distributed as dist
    assert not dist.is_initialized(), 'the broken NCCL group was not left'
