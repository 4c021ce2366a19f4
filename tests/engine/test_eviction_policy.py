"""Eviction that measures reuse, end to end on a tiny hybrid model with small pools (the issue-27 workloads).

Requests run one at a time; each is a shared system prompt plus 20 tokens of its own, and decodes 4 tokens.
Block size 16. The model's recurrent state is widened (8 value heads of 64) so that a state row dominates what a
checkpoint holds, as in large hybrid models (a row of tens of MiB against a 300 KB logits row); with the default
tiny model the kept logits alone would decide the order. The earlier eviction by value (lowest step per byte among
the 16 least recently used) lost both workloads: 6 of 32 hits on the 18-row pool, 29 of 40 on the 40-block pool.
"""
from __future__ import annotations

import pytest
import torch
from engines import engine_factory
from numeric import assert_close

from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.messages import SamplingParams

B = 16
WIDE_STATE = dict(linear_value_head_dim=64, linear_num_value_heads=8)


@pytest.fixture(scope='module')
def path(tiny_model_factory):
    return tiny_model_factory('qwen3_5', **WIDE_STATE)


def ids(length: int, seed: int) -> list[int]:
    return torch.randint(0, 1000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def serve_one_at_a_time(engine: Engine, prompts: list[list[int]], keep_logits: set[int] = frozenset()):
    """cached tokens per request (and collected logits / tokens of the requests in `keep_logits`)."""
    cached, kept = [], {}
    for i, prompt in enumerate(prompts):
        got = []
        seq_id = engine.add_request(prompt, SamplingParams(max_new_tokens=4), callback=got.append,
                                    collect_logits=i in keep_logits)
        while engine.has_work:
            engine.step()
            engine.check_integrity()
        cached.append(got[-1].num_cached)
        if i in keep_logits:
            kept[i] = (engine.pop_collected_logits(seq_id), [t for out in got for t in out.new_token_ids])
    return cached, kept


make_engine = engine_factory(block_size=B, kernel_block_size=8, max_prefill_token_num=512, enable_prefix_caching=True)


def check_against_cold(path: str, prompts: list[list[int]], cached: list[int], kept: dict) -> None:
    cold = make_engine(path, cache=False, num_gpu_blocks=64, max_batch_size=2)
    for i, (logits, tokens) in kept.items():
        (_, (ref_logits, ref_tokens)) = serve_one_at_a_time(cold, [prompts[i]], keep_logits={0})[1].popitem()
        assert tokens == ref_tokens
        assert_close(logits, ref_logits[cached[i]:], atol=1e-4, rtol=0, what=f'request {i} (cached {cached[i]})')


def test_a_hot_shared_prefix_survives_a_stream_of_one_off_checkpoints_on_an_18_row_pool(path):
    # max_batch_size 16: 18 state rows (dummy, 16 runtime, 1 spare), no extra budget. Request 2 finds the system
    # prompt inside request 1's and leaves a branch point at 200; every request leaves two one-off checkpoints
    # (prompt end 220, reply 223), so the pool fills after ~8 requests and each later one evicts.
    system = ids(200, 1)
    prompts = [system + ids(20, 100 + i) for i in range(32)]
    engine = make_engine(path, max_batch_size=16, num_gpu_blocks=512)
    cached, kept = serve_one_at_a_time(engine, prompts, keep_logits={2, 31})
    assert cached == [0, 0] + [200] * 30
    assert engine.stats['evictions_by_cause'].get('state', 0) > 20, 'the state pool never filled'
    check_against_cold(path, prompts, cached, kept)


@pytest.mark.parametrize('value_eviction', [True, False])
def test_exact_beats_aligned_on_the_40_block_workload(path, value_eviction):
    # A full 40-block pool (2.7 requests of 225 tokens), 18 state rows: KV pressure. The hot checkpoint is the
    # branch point at 205 (12 blocks + 13 tokens: a frozen partial block); aligned mode can only keep 192.
    # Partial checkpoints and trie leaves compete in one order, so the hot partial one outlives cold leaves.
    system = ids(205, 2)
    prompts = [system + ids(20, 200 + i) for i in range(40)]
    pools = dict(max_batch_size=16, num_gpu_blocks=40, prefix_cache_value_eviction=value_eviction)
    exact = make_engine(path, **pools)
    cached, kept = serve_one_at_a_time(exact, prompts, keep_logits={39})
    aligned = make_engine(path, prefix_cache_checkpoint_mode='aligned', **pools)
    aligned_cached, _ = serve_one_at_a_time(aligned, prompts)
    assert cached == [0, 0] + [205] * 38
    assert aligned_cached == [0, 0] + [192] * 38
    assert exact.stats['evictions_by_cause'].get('kv', 0) > 20, 'no KV pressure'
    check_against_cold(path, prompts, cached, kept)
