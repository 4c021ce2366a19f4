"""Prefix caching end to end on tiny CPU models: exact `cached_tokens`, warm == cold, eviction, invariants.

Every warm (cache-on) result is compared with a cache-off control engine: the logits of the tokens a warm request
actually feeds (`[cached, n)` plus the generated ones) must equal the control's logits of the same positions.
Geometry: block_size B = 16, kernel pages of 8 tokens (2 pages per block). Dense Qwen3 reuses whole blocks:
`cached = B * min(matched full blocks, (n - 1) // B)`. Hybrid models (Qwen3.5, Qwen3-Next; conv kernel 4) resume
from the deepest published state checkpoint at or before `n - 1`; checkpoints are taken at every prefill end and
chunk end (and, opt-in, every `prefix_cache_decode_state_interval` decoded tokens). On top of that base design the
default policies keep the prompt-end logits (an identical prompt resumes at `n`), end a prefill chunk at a branch
point, checkpoint a finished request after its reply, and evict by value; tests name the policy they depend on.
Every test checks the block / state-slot accounting after every engine step. The runs and the geometry are in
`prefix_cache_runs.py`; where checkpoints are taken is tested in `test_prefix_cache_checkpoints.py`, the device-side
invariants in `test_prefix_cache_device_side.py`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
from numeric import assert_close
from prefix_cache_runs import (
    ARCHS,
    ATOL,
    BASE,
    DENSE,
    HYBRID,
    B,
    assert_warm_equals_cold,
    check_against_cold,
    drive,
    generate,
    ids,
    live_steps,
    make_engine,
    one,
)

import lmdeploy
from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.messages import SamplingParams
from lmdeploy.pytorch.paging.scheduler import SchedulerOutput


# ---- exact cached_tokens for designed geometries ----------------------------------------------------------------
@pytest.mark.parametrize('arch', ARCHS)
@pytest.mark.parametrize('prefix_len', [B - 1, B, B + 1, 2 * B, 2 * B + 5, 2 * B + 15, 3 * B + 9])
def test_prefix_request_then_extension_hits_exactly(model_path, arch, prefix_len):
    # The first request's prompt is the prefix; the second appends 6 tokens. Hybrid: the prefix's prefill-end
    # checkpoint is at exactly `prefix_len`. Dense: only the prefix's full blocks are cached.
    path = model_path(arch)
    engine = make_engine(path)
    prefix = ids(prefix_len, seed=prefix_len)
    first = one(engine, prefix)
    second = one(engine, prefix + ids(6, seed=1000 + prefix_len))
    expected = prefix_len if arch in HYBRID else prefix_len // B * B
    assert (first.cached, second.cached) == (0, expected)
    check_against_cold(path, [first, second])


@pytest.mark.parametrize('arch', ARCHS)
@pytest.mark.parametrize('length', [3 * B, 2 * B + 5])
@pytest.mark.parametrize('policy', ['default', 'base'])
def test_identical_prompts_sent_twice(model_path, arch, length, policy):
    # Two prompts in one batch (n = `length` and n = `length` + 3), then the same two again in one batch.
    path = model_path(arch)
    engine = make_engine(path, **(BASE if policy == 'base' else {}))
    prompts = [ids(length, seed=length), ids(length + 3, seed=7)]
    first = generate(engine, prompts, 3)
    again = generate(engine, prompts, 3)
    # Dense: (n - 1) // 16 blocks; the block holding the last prompt token is recomputed for the logits.
    # Hybrid, base design: 0. A one-chunk prompt's only checkpoint is at its end n, and matching stops at n - 1 so
    # that one token is computed: an identical repeat reuses nothing (prior-art trap 2).
    # Hybrid, default: the prompt-end checkpoint kept the last position's logits, so the whole prompt is served
    # (n) and the first token is sampled from them without a forward.
    for p, r in zip(prompts, again):
        n = len(p)
        assert r.cached == ((n - 1) // B * B if arch in DENSE else (0 if policy == 'base' else n))
    assert [r.cached for r in first] == [0, 0]
    cold = make_engine(path, cache=False)
    for p, r1, r2 in zip(prompts, first, again):
        reference = one(cold, p, 3)
        assert_warm_equals_cold(r1, reference)
        assert_warm_equals_cold(r2, reference)
        if r2.cached == len(p):
            (ck,) = [c for c in engine.scheduler.trie.checkpoints.live() if c.step == len(p)]
            assert_close(ck.last_logits, reference.logits[len(p) - 1], atol=ATOL, rtol=0, what='kept logits')


@pytest.mark.parametrize('arch', ARCHS)
def test_three_requests_branching_from_a_cached_prefix(model_path, arch):
    path = model_path(arch)
    engine = make_engine(path)
    prefix = ids(2 * B + 5, seed=5)             # 2 blocks + 5 tokens
    runs = [one(engine, prefix)] + [one(engine, prefix + ids(3 + 4 * k, seed=50 + k)) for k in range(3)]
    expected = 2 * B + 5 if arch in HYBRID else 2 * B
    assert [r.cached for r in runs] == [0, expected, expected, expected]
    check_against_cold(path, runs)


@pytest.mark.parametrize('arch', ARCHS)
@pytest.mark.parametrize('policy', ['default', 'base'])
def test_three_branches_without_a_prefix_request(model_path, arch, policy):
    # No request ends at the shared 37-token prefix. Dense: the 2 shared full blocks are reused.
    # Hybrid, base design: every checkpoint lies in a request's own suffix, past the branch point, so siblings never
    # hit (prior-art trap 1). Default: the second request finds that it diverges from a cached checkpoint tail at
    # 37, ends its first chunk there and checkpoints it; the third resumes at 37.
    path = model_path(arch)
    engine = make_engine(path, **(BASE if policy == 'base' else {}))
    prefix = ids(2 * B + 5, seed=5)
    runs = [one(engine, prefix + ids(7, seed=60 + k)) for k in range(3)]
    hybrid = [0, 0, 0] if policy == 'base' else [0, 0, 2 * B + 5]
    assert [r.cached for r in runs] == ([0, 2 * B, 2 * B] if arch in DENSE else hybrid)
    check_against_cold(path, runs)


@pytest.mark.parametrize('arch', ARCHS)
@pytest.mark.parametrize('policy', ['default', 'base'])
def test_branches_arriving_together_resume_at_their_common_prefix(model_path, arch, policy):
    # The same three branches as above, but submitted in one burst onto an empty cache. Default (hybrid): the
    # first request's queued peers make 37 a branch point, so its first chunk ends there and is checkpointed; the
    # other two wait one step and resume at 37 instead of recomputing it beside it. Base and dense: all three are
    # prefilled cold in one forward.
    path = model_path(arch)
    engine = make_engine(path, **(BASE if policy == 'base' else {}))
    prefix = ids(2 * B + 5, seed=5)
    with recording_schedules(engine) as outs:
        runs = generate(engine, [prefix + ids(7, seed=60 + k) for k in range(3)], max_new_tokens=2)
    waits = arch in HYBRID and policy == 'default'
    assert outs[0].out.num_new_tokens == ([2 * B + 5] if waits else [2 * B + 12] * 3)
    assert [r.cached for r in runs] == ([0, 2 * B + 5, 2 * B + 5] if waits else [0, 0, 0])
    check_against_cold(path, runs, 2)


@pytest.mark.parametrize('arch', ARCHS)
@pytest.mark.parametrize('shared, hybrid_hit, dense_hit', [(23 + 4, 23, B), (46 + 4, 46, 3 * B), (69 + 3, 69, 4 * B)])
def test_chunk_end_checkpoints_mid_block_are_hit_exactly(model_path, arch, shared, hybrid_hit, dense_hit):
    # 80-token prompt with 23-token chunks: chunk ends 23 (1 block + 7), 46 (2 blocks + 14), 69 (4 blocks + 5) and
    # the prefill end 80 (5 blocks). A second request sharing `shared` tokens resumes at the last chunk end before
    # the divergence (hybrid) or at the last full shared block (dense).
    path = model_path(arch)
    engine = make_engine(path, max_prefill_token_num=23)
    base = ids(80, seed=80)
    first = one(engine, base)
    if arch in HYBRID:
        checkpoints = sorted(engine.scheduler.trie.checkpoints.live(), key=lambda ck: ck.step)
        assert [(ck.step, ck.is_partial) for ck in checkpoints] == [(23, True), (46, True), (69, True), (80, False)]
    second = one(engine, base[:shared] + ids(9, seed=shared))
    assert second.cached == (hybrid_hit if arch in HYBRID else dense_hit)
    check_against_cold(path, [first, second])


@pytest.mark.parametrize('arch', HYBRID)
@pytest.mark.parametrize('prefix_len', [2 * B, 2 * B + 5])
@pytest.mark.parametrize('suffix_len', [1, 2, 3])
def test_suffix_shorter_than_the_conv_kernel_after_a_hit(model_path, arch, prefix_len, suffix_len):
    # 1-3 new tokens after a hit, batched with an unrelated cold prefill, then 4 decodes: the conv history must come
    # from the restored state (not the neighbour or padding). The checkpoint saved after the short segment is then
    # resumed by a third request.
    path = model_path(arch)
    engine = make_engine(path)
    prefix = ids(prefix_len, seed=prefix_len)
    first = one(engine, prefix)
    short = prefix + ids(suffix_len, seed=7)
    second, neighbour = generate(engine, [short, ids(21, seed=8)], max_new_tokens=4)
    third = one(engine, short + ids(5, seed=9))
    assert (first.cached, second.cached, neighbour.cached, third.cached) == (0, prefix_len, 0,
                                                                               prefix_len + suffix_len)
    cold = make_engine(path, cache=False)
    assert_warm_equals_cold(first, one(cold, prefix))
    assert_warm_equals_cold(second, one(cold, short, 4))
    assert_warm_equals_cold(neighbour, one(cold, neighbour.prompt, 4))
    assert_warm_equals_cold(third, one(cold, third.prompt))


@dataclass
class Scheduled:
    out: SchedulerOutput
    pins: list[int]              # pin count of each pinned checkpoint right after scheduling
    block_ids: list[list[int]]   # each scheduled sequence's blocks right after scheduling


@contextlib.contextmanager
def recording_schedules(engine: Engine):
    """Yields the list of `Scheduled` records of every forward while the block is active."""
    outs, schedule = [], engine.scheduler.schedule

    def wrapped():
        out = schedule()
        outs.append(Scheduled(out, [ck.pin_count for ck in out.pinned], [list(s.block_ids) for s in out.seqs]))
        return out

    engine.scheduler.schedule = wrapped
    try:
        yield outs
    finally:
        engine.scheduler.schedule = schedule


@pytest.mark.parametrize('arch', HYBRID)
def test_one_checkpoint_restored_into_four_requests_in_one_forward(model_path, arch):
    path = model_path(arch)
    engine = make_engine(path)
    prefix = ids(2 * B + 5, seed=11)
    first = one(engine, prefix)
    (ck,) = [c for c in engine.scheduler.trie.checkpoints.live() if c.step == 2 * B + 5]
    prompts = [prefix + ids(k, seed=20 + k) for k in (3, 5, 8, 13)]
    with recording_schedules(engine) as outs:
        runs = generate(engine, prompts, max_new_tokens=3)
    out = outs[0].out
    assert len(out.seqs) == 4 and outs[0].pins == [4, 4, 4, 4]
    assert [src for src, _ in out.state_restores] == [ck.slot] * 4 and len({d for _, d in out.state_restores}) == 4
    assert [src for src, _ in out.kv_restores] == [ck.frozen_block_id] * 4
    assert len({dst for _, dst in out.kv_restores}) == 4
    assert ck.pin_count == 0
    assert [r.cached for r in runs] == [2 * B + 5] * 4
    check_against_cold(path, [first], 1)
    check_against_cold(path, runs, 3)


@pytest.mark.parametrize('arch', ARCHS)
def test_requests_diverging_after_a_shared_partial_block_stay_isolated(model_path, arch):
    # Both resume at 37 (2 blocks + 5) and write different tokens at 37.. into their own copy of block 2, in the same
    # forward; then a third request resumes from the same (unchanged) frozen block.
    path = model_path(arch)
    engine = make_engine(path)
    prefix = ids(2 * B + 5, seed=12)
    first = one(engine, prefix)
    with recording_schedules(engine) as outs:
        a, b = generate(engine, [prefix + ids(10, seed=1), prefix + ids(10, seed=2)], max_new_tokens=3)
    blocks_a, blocks_b = outs[0].block_ids
    assert len(outs[0].out.seqs) == 2
    assert blocks_a[:2] == blocks_b[:2] and blocks_a[2] != blocks_b[2]  # blocks 0, 1 shared; block 2 private
    if arch in HYBRID:
        ck = outs[0].out.pinned[0]
        assert ck.frozen_block_id not in (blocks_a[2], blocks_b[2])
        assert outs[0].out.kv_restores == [(ck.frozen_block_id, blocks_a[2]), (ck.frozen_block_id, blocks_b[2])]
    c = one(engine, prefix + ids(4, seed=3))
    expected = 2 * B + 5 if arch in HYBRID else 2 * B
    assert [r.cached for r in (first, a, b, c)] == [0, expected, expected, expected]
    check_against_cold(path, [first, c])
    check_against_cold(path, [a, b], 3)


@pytest.mark.parametrize('arch', ARCHS)
@pytest.mark.parametrize('policy', ['default', 'base'])
def test_same_prefix_twice_in_one_batch(model_path, arch, policy):
    path = model_path(arch)
    engine = make_engine(path, **(BASE if policy == 'base' else {}))
    prefix = ids(2 * B + 5, seed=13)
    with recording_schedules(engine) as outs:
        r1, r2 = generate(engine, [prefix, prefix], max_new_tokens=1)
    waits = arch in HYBRID and policy == 'default'
    if waits:
        # Default (branch points in flight): the first copy's prompt-end checkpoint is scheduled in this forward, so
        # the second copy waits one step and is then served whole from it and its kept logits, without a forward.
        assert [len(o.out.seqs) for o in outs] == [1, 0] and len(outs[1].out.logits_hits) == 1
    else:
        assert len(outs[0].out.seqs) == 2         # both cold, in the same forward
    if arch in HYBRID:
        # Base: both reserve a checkpoint at 37 (neither is published yet); the second publication is a duplicate
        # and is dropped.
        assert live_steps(engine) == [2 * B + 5] and engine.stats['checkpoints_saved'] == 1
    assert engine.scheduler.trie.kv.num_nodes == 2
    r3 = one(engine, prefix + ids(6, seed=14))
    assert [r.cached for r in (r1, r2, r3)] == [0, 2 * B + 5 if waits else 0, 2 * B + 5 if arch in HYBRID else 2 * B]
    assert r2.generated == r1.generated
    check_against_cold(path, [r1, r3] if waits else [r1, r2, r3])  # a whole-prompt hit fed nothing to compare


# ---- eviction -----------------------------------------------------------------------------------------------------
def eviction_workload() -> list[list[list[int]]]:
    """Waves of prompts (each wave submitted together) over three families of shared prefixes."""
    p1, p2, p3 = ids(37, 101), ids(29, 102), ids(50, 103)
    return [
        [p1], [p1 + ids(9, 1), p2], [p2 + ids(4, 2)], [p3, p1 + ids(9, 1) + ids(5, 3)],
        [p3 + ids(6, 4), p2 + ids(4, 2) + ids(3, 5)], [p1 + ids(20, 6)], [p1, p3 + ids(6, 4) + ids(2, 7)],
        [p2 + ids(11, 8), p1 + ids(9, 1)],
    ]


# (arch, KV blocks, state budget): 10 blocks = 160 tokens for two running requests of up to 60 tokens puts the KV
# pool under pressure; max_batch_size 2 gives 4 + budget state rows (dummy, 2 runtime, 1 spare), so a budget of
# 0-1 with a roomy KV pool puts the state pool under pressure; 16 blocks gives some of both.
POOLS = [('qwen3', 10, 0, 'default'), ('qwen3_5', 10, 0, 'default'), ('qwen3_5', 10, 2, 'base'),
         ('qwen3_5', 16, 0, 'default'), ('qwen3_5', 40, 1, 'base'), ('qwen3_next', 10, 1, 'default'),
         ('qwen3_next', 16, 2, 'base'), ('qwen3_next', 40, 0, 'default')]


@pytest.mark.parametrize('arch, num_blocks, budget, policy', POOLS)
def test_eviction_under_tiny_pools_keeps_outputs_and_invariants(model_path, arch, num_blocks, budget, policy):
    path = model_path(arch)
    tiny = dict(num_gpu_blocks=num_blocks, max_batch_size=2, prefix_cache_state_budget=budget)
    engine = make_engine(path, **tiny, **(BASE if policy == 'base' else {}))
    trie = engine.scheduler.trie
    detached = []

    if trie.checkpoints is not None:
        lifecycle, release, detach = trie.checkpoints, trie.checkpoints.release, trie.kv.detach

        def checked_release(ck):
            assert ck.pin_count == 0, 'a pinned checkpoint was released'
            release(ck)

        def checked_detach(node):
            detached.append(node)
            detach(node)

        evict_leaf = trie.eviction.evict_leaf

        def checked_evict_leaf(priority, leaf):
            # Partial checkpoints and leaves compete in one order: none of lower or equal priority remains.
            cheaper = [ck for ck in lifecycle.live()
                       if ck.is_partial and lifecycle.is_evictable(ck) and ck.priority <= priority]
            assert not cheaper, 'a trie leaf was evicted before a partial checkpoint of no higher priority'
            evict_leaf(priority, leaf)

        lifecycle.release, trie.kv.detach = checked_release, checked_detach
        trie.eviction.evict_leaf = checked_evict_leaf

    def after_step():
        if trie.checkpoints is not None:
            assert all(ck.pin_count == 0 for ck in trie.checkpoints.live()), 'pins outlive their forward'

    with recording_schedules(engine) as outs:
        warm = [generate(engine, wave, max_new_tokens=3, after_step=after_step) for wave in eviction_workload()]
    # Restores happened (pinned at admission, while later admissions and reservations of the same schedule evicted
    # around them); the wrappers saw every leaf eviction.
    assert any(rec.out.pinned for rec in outs) == (arch in HYBRID)
    assert len(detached) == (engine.stats['evicted_blocks'] if arch in HYBRID else 0)
    cold = make_engine(path, cache=False, **tiny)
    for wave in warm:
        for run in wave:
            assert_warm_equals_cold(run, one(cold, run.prompt, 3))
    # Engagement guards: the workload must hit and must evict what this pool is short of.
    stats, causes = engine.stats, engine.stats['evictions_by_cause']
    assert stats['hit_tokens'] > 0, 'the cache never hit'
    if num_blocks <= 10:
        assert stats['evicted_blocks'] > 0, 'no trie leaf was evicted under KV pressure'
        assert causes.get('kv', 0) > 0 or arch in DENSE, 'no partial checkpoint was evicted under KV pressure'
    if num_blocks >= 16 and arch in HYBRID:
        assert causes.get('state', 0) > 0, 'no checkpoint was evicted under state pressure'
    assert stats['evicted_checkpoints'] == sum(causes.values())
    assert engine.scheduler.block_manager.num_free + sum(trie.owners()[0].values()) == num_blocks


# ---- statistics and the user surface ------------------------------------------------------------------------------
@pytest.mark.parametrize('arch', ['qwen3', 'qwen3_5'])
def test_stats_and_cached_tokens_through_the_pipeline(model_path, arch):
    path = model_path(arch)
    config = PytorchEngineConfig(device_type='cpu', block_size=B, num_gpu_blocks=64, max_batch_size=4,
                                 enable_prefix_caching=True, prefix_cache_state_budget=8)
    prefix = ids(2 * B + 5, seed=23)
    prompts = [prefix, prefix + ids(6, seed=24), prefix + ids(9, seed=25)]
    gen = GenerationConfig(max_new_tokens=2, ignore_eos=True)
    with lmdeploy.pipeline(path, backend_config=config) as pipe:
        responses = [pipe(p, gen) for p in prompts]
        pipe_stats = pipe.engine.stats
    engine = Engine(path, config)
    runs = [one(engine, p, 2) for p in prompts]
    expected = 2 * B + 5 if arch in HYBRID else 2 * B
    assert [r.cached_tokens for r in responses] == [r.cached for r in runs] == [0, expected, expected]
    assert [r.token_ids for r in responses] == [r.generated for r in runs]
    query = sum(len(p) for p in prompts)
    assert pipe_stats == engine.stats
    stats = engine.stats
    assert (stats['query_tokens'], stats['hit_tokens'], stats['num_requests'], stats['num_hits']) == (
        query, 2 * expected, 3, 2)
    assert stats['hit_rate'] == pytest.approx(2 * expected / query)
    # Hybrid: per request its prefill end and, after its 2-token reply, the reply checkpoint (prompt + 1).
    assert stats['live_checkpoints'] == (6 if arch in HYBRID else 0)
    assert (stats['evicted_checkpoints'], stats['evicted_blocks']) == (0, 0)
    off = make_engine(path, cache=False)
    one(off, prefix)
    assert off.stats['hit_tokens'] == 0 and off.stats['live_checkpoints'] == 0


@pytest.mark.parametrize('arch', ['qwen3', 'qwen3_5'])
def test_a_raising_output_callback_does_not_skip_the_cache_bookkeeping(model_path, arch, caplog):
    """Tokens are delivered before the step's prefix-cache bookkeeping; a consumer whose callback raises must not
    cut that bookkeeping short: its prompt is still cached, its reply checkpoint saved, nothing leaks."""
    path = model_path(arch)
    engine = make_engine(path)
    prompt = ids(2 * B + 5, seed=41)
    seen = []

    def boom(out):
        seen.append(out)
        raise RuntimeError('consumer failed')

    engine.add_request(prompt, SamplingParams(max_new_tokens=3), callback=boom)
    drive(engine)
    assert len(seen) == 3 and seen[-1].finished  # every output still went out
    assert 'output callback of request' in caplog.text
    engine.check_integrity()
    reply = [t for out in seen for t in out.new_token_ids]
    follow = one(engine, prompt + reply[:2] + ids(6, seed=42))
    # hybrid: the reply checkpoint (prompt + the 2 reply tokens fed back); dense: the full blocks of those tokens
    assert follow.cached == (2 * B if arch in DENSE else 2 * B + 7)
