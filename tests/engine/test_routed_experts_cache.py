"""Routed experts through the prefix cache: a request served from a hit returns exactly the routes it returns with
the cache off (warm equals cold), whether it resumes at an aligned step, at an unaligned one (the checkpoint's
partial tail), from a reply checkpoint, or as an identical prompt (no forward at all).

Geometry: block_size 16, tiny Qwen3-Next (hybrid; MoE layers 0, 1, 3, top-2), float32 on the CPU.
"""
from __future__ import annotations

import numpy as np
import pytest
from engines import engine_factory
from routes_reference import Finished, assert_routes_match, build_qwen3_next, prompt, reference_routes

from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.messages import SamplingParams

B = 16


make_engine = engine_factory(block_size=B, kernel_block_size=8, num_gpu_blocks=96, max_batch_size=8,
                             max_prefill_token_num=256, enable_return_routed_experts=True)


@pytest.fixture(scope='module')
def moe(tiny_model_factory):
    return build_qwen3_next(tiny_model_factory)


def run(engine: Engine, token_ids: list[int], n: int = 4, routed: bool = True) -> Finished:
    done = Finished()
    engine.add_request(token_ids, SamplingParams(max_new_tokens=n, return_routed_experts=routed), callback=done)
    while engine.has_work:
        engine.step()
        engine.check_integrity()
    return done


def assert_warm_equals_cold(path: str, warm: Engine, token_ids: list[int], cached: int, **overrides) -> Finished:
    hot = run(warm, token_ids)
    cold = run(make_engine(path, cache=False, **overrides), token_ids)
    assert hot.final.num_cached == cached
    assert hot.tokens == cold.tokens
    np.testing.assert_array_equal(hot.final.routed_experts, cold.final.routed_experts)
    return hot


def test_hit_at_an_aligned_step(moe):
    path, model = moe
    engine = make_engine(path, cache=True, max_prefill_token_num=16)  # chunk ends (checkpoints) at 16, 32
    first = prompt(40, seed=1)
    run(engine, first)
    second = first[:32] + prompt(9, seed=2)
    hot = assert_warm_equals_cold(path, engine, second, cached=32, max_prefill_token_num=16)
    tokens = second + hot.tokens
    assert_routes_match(hot.final.routed_experts, reference_routes(model, tokens[:-1]), 2)


def test_hit_at_an_unaligned_step_replays_the_partial_tail(moe):
    path, model = moe
    engine = make_engine(path, cache=True)
    first = prompt(21, seed=3)                         # prompt-end checkpoint at 21: 1 block + 5 tokens
    run(engine, first)
    second = first + prompt(7, seed=4)
    hot = assert_warm_equals_cold(path, engine, second, cached=21)
    assert_routes_match(hot.final.routed_experts, reference_routes(model, (second + hot.tokens)[:-1]), 2)


def test_hit_from_a_reply_checkpoint(moe):
    path, _ = moe
    engine = make_engine(path, cache=True)
    first = prompt(13, seed=5)
    reply = run(engine, first, n=6).tokens             # reply checkpoint at 13 + 6 - 1 = 18 (unaligned)
    second = first + reply + prompt(5, seed=6)
    assert_warm_equals_cold(path, engine, second, cached=18)


def test_identical_prompt_replays_every_prompt_row(moe):
    path, _ = moe
    engine = make_engine(path, cache=True)
    first = prompt(19, seed=7)
    run(engine, first)
    hot = assert_warm_equals_cold(path, engine, first, cached=19)  # kept logits: no prefill forward at all
    assert hot.final.routed_experts.shape == (19 + 4 - 1, 3, 2)
    assert engine.stats['logits_hits'] == 1


def test_a_request_that_did_not_ask_still_leaves_routes_for_later_hits(moe):
    path, _ = moe
    engine = make_engine(path, cache=True)
    first = prompt(21, seed=8)
    out = run(engine, first, routed=False)
    assert out.final.routed_experts is None
    assert_warm_equals_cold(path, engine, first + prompt(3, seed=9), cached=21)


def test_missing_routes_recompute_from_the_deepest_provable_point(moe):
    path, _ = moe
    engine = make_engine(path, cache=True, max_prefill_token_num=16)
    first = prompt(40, seed=10)
    run(engine, first)
    trie = engine.scheduler.trie
    block1 = trie.kv.root(None).children
    node0 = next(iter(block1.values()))
    node1 = next(iter(node0.children.values()))
    trie.drop_block_routes(node1)                       # block [16, 32) lost its routes: 32 is no longer provable
    second = first[:32] + prompt(9, seed=11)
    before = dict(engine.stats['miss_reasons'])
    assert_warm_equals_cold(path, engine, second, cached=16, max_prefill_token_num=16)
    after = engine.stats['miss_reasons']
    assert after.get('routes_missing', 0) - before.get('routes_missing', 0) == 16


def test_the_cache_reports_route_memory(moe):
    path, _ = moe
    engine = make_engine(path, cache=True)
    run(engine, prompt(37, seed=12), n=3)               # prompt-end checkpoint at 37, reply checkpoint at 39
    stats = engine.stats
    assert stats['routed_experts_bytes_per_token'] == 3 * 2 * 2  # MoE layers x top-k x uint16
    trie = engine.scheduler.trie
    nodes = [n for n in _walk(trie.kv.root(None)) if not n.is_root]
    tails = [ck.step % B for ck in trie.checkpoints.live()]
    assert len(nodes) == 2 and sorted(tails) == [5, 7]
    assert stats['routed_experts_cached_bytes'] == (2 * B + 5 + 7) * 12


def test_without_the_flag_the_cache_keeps_no_routes(moe):
    path, _ = moe
    engine = make_engine(path, cache=True, enable_return_routed_experts=False)
    run(engine, prompt(37, seed=13), routed=False)
    trie = engine.scheduler.trie
    assert all(n.routes is None for n in _walk(trie.kv.root(None)))
    assert all(ck.routes_tail is None for ck in trie.checkpoints.live())
    assert 'routed_experts_cached_bytes' not in engine.stats


def _walk(node):
    yield node
    for child in node.children.values():
        yield from _walk(child)


@pytest.mark.gpu
def test_cuda_hits_replay_routes_that_match_the_cpu_engine(moe):
    # float32 on the GPU, CUDA graphs on (decodes replay graphs that record): the warm request's rows, replayed
    # ones included, against the CPU engine (default backend, cache off), teacher-forced on the GPU run's tokens.
    # The CPU engine is the reference because with fla-core installed transformers binds fla's kernels, which fail
    # on CPU tensors; the CPU tests above check the CPU engine's routes against transformers' router top-k.
    path, _ = moe
    engine = make_engine(path, cache=True, device_type='cuda', dtype='float32')
    first = prompt(21, seed=3)
    run(engine, first)
    second = first + prompt(7, seed=4)
    hot = run(engine, second)
    assert hot.final.num_cached == 21
    assert engine.agent.graph_runner.num_replays > 0
    tokens = second + hot.tokens
    ref = run(make_engine(path, cache=False), tokens[:-1], n=1).final.routed_experts
    got = hot.final.routed_experts
    assert got.shape == ref.shape == (len(tokens) - 1, 3, 2)
    np.testing.assert_array_equal(np.sort(got, axis=-1), np.sort(ref, axis=-1))
