"""Prefix caching end to end on tiny CPU models: exact `cached_tokens`, warm == cold, eviction, invariants.

Every warm (cache-on) result is compared with a cache-off control engine: the logits of the tokens a warm request
actually feeds (`[cached, n)` plus the generated ones) must equal the control's logits of the same positions.
Geometry: block_size B = 16, kernel pages of 8 tokens (2 pages per block). Dense Qwen3 reuses whole blocks:
`cached = B * min(matched full blocks, (n - 1) // B)`. Hybrid models (Qwen3.5, Qwen3-Next; conv kernel 4) resume
from the deepest published state checkpoint at or before `n - 1`; checkpoints are taken at every prefill end and
chunk end (and, opt-in, every `prefix_cache_decode_state_interval` decoded tokens). On top of that base design the
default policies keep the prompt-end logits (an identical prompt resumes at `n`), end a prefill chunk at a branch
point, checkpoint a finished request after its reply, and evict by value; tests name the policy they depend on.
Every test checks the block / state-slot accounting after every engine step.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import pytest
import torch
from engines import engine_factory
from numeric import assert_close

import lmdeploy
from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels.default import paged_attention
from lmdeploy.pytorch.messages import SamplingParams
from lmdeploy.pytorch.paging.scheduler import SchedulerOutput

B = 16
ATOL = 1e-4
MAX_STEPS = 1000
DENSE, HYBRID = ('qwen3',), ('qwen3_5', 'qwen3_next')
ARCHS = DENSE + HYBRID
# Engines run with the shipped defaults unless a test says otherwise. The checkpoint policies layered on the base
# design (prompt-end logits, branch points, reply checkpoints, value eviction) change some exact numbers; tests of
# the base mechanism switch off the ones that would, by name.
NO_REPLY = dict(prefix_cache_reply_checkpoints=False)
BASE = dict(prefix_cache_reply_checkpoints=False, prefix_cache_prompt_logits=False,
            prefix_cache_branch_checkpoints=False, prefix_cache_value_eviction=False)


# ---- helpers ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope='module', autouse=True)
def single_thread():
    """Tiny models gain nothing from intra-op threads, and spinning OpenMP workers slow the run ~10x on a shared
    CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope='module')
def model_path(tiny_model_factory):
    return lambda arch: tiny_model_factory(arch)


make_engine = engine_factory(block_size=B, kernel_block_size=8, num_gpu_blocks=96, max_batch_size=8,
                             max_prefill_token_num=512, enable_prefix_caching=True)


def ids(length: int, seed: int) -> list[int]:
    return torch.randint(0, 1000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@dataclass
class Run:
    prompt: list[int]
    cached: int = 0                                        # EngineOutput.num_cached
    generated: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None                     # [fed tokens, vocab]: prompt[cached:] + generated[:-1]


def submit(engine: Engine, prompt: list[int], max_new_tokens: int = 1) -> tuple[int, Run]:
    run = Run(list(prompt))

    def on_output(out):
        run.cached = out.num_cached
        run.generated += out.new_token_ids

    return engine.add_request(prompt, SamplingParams(max_new_tokens=max_new_tokens), callback=on_output,
                              collect_logits=True), run


def drive(engine: Engine, after_step=None) -> None:
    """Step until idle, checking the KV / state-slot accounting after every step."""
    for _ in range(MAX_STEPS):
        if not engine.has_work:
            return
        engine.step()
        engine.check_integrity()
        if after_step is not None:
            after_step()
    raise AssertionError(f'the engine is still busy after {MAX_STEPS} steps (a request is never admitted?)')


def generate(engine: Engine, prompts: list[list[int]], max_new_tokens: int = 1, after_step=None) -> list[Run]:
    """Submit all prompts at once (they share forwards), run to idle."""
    pending = [submit(engine, p, max_new_tokens) for p in prompts]
    drive(engine, after_step)
    for seq_id, run in pending:
        run.logits = engine.pop_collected_logits(seq_id)
    return [run for _, run in pending]


def one(engine: Engine, prompt: list[int], max_new_tokens: int = 1) -> Run:
    return generate(engine, [prompt], max_new_tokens)[0]


def assert_warm_equals_cold(warm: Run, cold: Run) -> None:
    assert cold.cached == 0
    assert warm.generated == cold.generated, 'greedy tokens differ between warm and cold'
    assert warm.logits.shape[0] == len(warm.prompt) - warm.cached + len(warm.generated) - 1
    assert_close(warm.logits, cold.logits[warm.cached:], atol=ATOL, rtol=0, what=f'warm logits (cached {warm.cached})')


def check_against_cold(path: str, warm_runs: list[Run], max_new_tokens: int = 1, **overrides) -> None:
    """Replay every warm prompt on a cache-off engine and compare."""
    cold = make_engine(path, cache=False, **overrides)
    for warm in warm_runs:
        assert_warm_equals_cold(warm, one(cold, warm.prompt, max_new_tokens))


def live_steps(engine: Engine) -> list[int]:
    return sorted(ck.step for ck in engine.scheduler.trie.checkpoints.live())


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


# ---- checkpoint modes on a multi-turn chat ------------------------------------------------------------------------
def chat(engine: Engine, turns: int = 5, reply_len: int = 8) -> tuple[list[Run], list[int]]:
    """Turn k's prompt = turn k-1's prompt + its reply + new user tokens (30, 47, 64, 81, 98 tokens)."""
    prompt, runs = ids(30, seed=200), []
    for k in range(turns):
        run = one(engine, prompt, reply_len)
        runs.append(run)
        prompt = prompt + run.generated + ids(9, seed=201 + k)
    return runs, [r.cached for r in runs]


@pytest.mark.parametrize('arch', HYBRID)
@pytest.mark.parametrize('policy, exact_hits, aligned_hits', [
    # Base design: each turn resumes where the previous prompt ended (the reply is recomputed). Aligned: of the
    # prompt ends only 64 = 4 blocks is a block multiple.
    ('base', [0, 30, 47, 64, 81], [0, 0, 0, 64, 64]),
    # Default: a finished request leaves a checkpoint after its reply (prompt + 8 - 1 fed tokens), so each turn
    # resumes after the previous reply. Aligned keeps block multiples only: no reply checkpoint qualifies, but each
    # turn ends its first chunk at the last block boundary before it diverges from the cached reply (32 in turn
    # 2, 48 in turn 3, 80 in turn 5) and checkpoints it.
    ('default', [0, 37, 54, 71, 88], [0, 0, 32, 64, 64]),
])
def test_exact_checkpoints_beat_aligned_on_multi_turn_chat(model_path, arch, policy, exact_hits, aligned_hits):
    path = model_path(arch)
    knobs = BASE if policy == 'base' else {}
    off_runs, off_hits = chat(make_engine(path, cache=False))
    aligned_runs, aligned = chat(make_engine(path, prefix_cache_checkpoint_mode='aligned', **knobs))
    exact_runs, exact = chat(make_engine(path, prefix_cache_checkpoint_mode='exact', **knobs))
    assert off_hits == [0] * 5
    assert (exact, aligned) == (exact_hits, aligned_hits)
    assert sum(exact) > sum(aligned)
    for off, aligned_run, exact_run in zip(off_runs, aligned_runs, exact_runs):
        assert off.generated == aligned_run.generated == exact_run.generated
        assert_warm_equals_cold(aligned_run, off)
        assert_warm_equals_cold(exact_run, off)


# ---- decode checkpoints -----------------------------------------------------------------------------------------
@pytest.mark.parametrize('arch', HYBRID)
@pytest.mark.parametrize('interval, knobs, steps', [
    (0, NO_REPLY, [2 * B + 5]),
    (B, NO_REPLY, [2 * B + 5, 3 * B]),
    (B, {}, [2 * B + 5, 3 * B, 2 * B + 5 + 19]),    # + the reply checkpoint after the 19 fed generated tokens
])
def test_follow_up_resumes_from_a_decode_checkpoint(model_path, arch, interval, knobs, steps):
    # 37-token prompt, 20 generated tokens: decodes feed positions 37..55 (steps 38..56); with interval 16 the step
    # 48 = 3 blocks is saved. A follow-up containing the whole exchange resumes at the deepest checkpoint.
    path = model_path(arch)
    engine = make_engine(path, prefix_cache_decode_state_interval=interval, **knobs)
    first = one(engine, ids(2 * B + 5, seed=15), max_new_tokens=20)
    assert live_steps(engine) == steps
    assert [ck.is_partial for ck in sorted(engine.scheduler.trie.checkpoints.live(), key=lambda c: c.step)] == [
        step % B != 0 for step in steps]
    follow = one(engine, first.prompt + first.generated + ids(5, seed=16), max_new_tokens=3)
    assert follow.cached == steps[-1]
    check_against_cold(path, [first], 20)
    check_against_cold(path, [follow], 3)


# ---- in-prefill checkpoints ---------------------------------------------------------------------------------------
@pytest.mark.parametrize('arch', HYBRID)
@pytest.mark.parametrize('chunk, cap, steps, hits', [
    (512, 4, [64, 128, 192, 256, 300], (128, 64)),            # one piece: cuts at the 4 multiples of 64 in it
    (100, 4, [64, 100, 128, 192, 200, 256, 300], (128, 64)),  # pieces [0,100) [100,200) [200,300): 64|192,128|256
    (512, 2, [192, 256, 300], (0, 64)),   # the cap keeps the deepest cuts; the 149-token 2nd prompt cuts 128, 64
])
def test_in_prefill_checkpoints_are_hit_exactly(model_path, arch, chunk, cap, steps, hits):
    # A 300-token prompt with in-prefill checkpoints every 64 tokens (block-aligned: no frozen block); later
    # prompts diverging at 140 and 70 resume from the deepest checkpoint before the divergence (branch points off).
    path = model_path(arch)
    engine = make_engine(path, max_prefill_token_num=chunk, prefix_cache_prefill_state_interval=64,
                         prefix_cache_prefill_state_cap=cap, num_gpu_blocks=128, **BASE)
    base = ids(300, seed=300)
    first = one(engine, base)
    assert live_steps(engine) == steps
    assert all(ck.is_partial == (ck.step % B != 0) for ck in engine.scheduler.trie.checkpoints.live())
    runs = [first]
    for shared, hit in zip((140, 70), hits):
        run = one(engine, base[:shared] + ids(9, seed=shared), max_new_tokens=3)
        assert run.cached == hit
        runs.append(run)
    check_against_cold(path, runs[:1])
    check_against_cold(path, runs[1:], 3)


@pytest.mark.parametrize('arch', HYBRID)
def test_in_prefill_checkpoints_use_only_free_state_rows(model_path, arch):
    # No state budget and 4 running slots' worth of rows: cuts take free rows only and never evict the system
    # prompt's checkpoint, which later prompts still hit.
    path = model_path(arch)
    engine = make_engine(path, prefix_cache_prefill_state_interval=32, prefix_cache_prefill_state_cap=8,
                         max_batch_size=2, num_gpu_blocks=128, **BASE)
    system = ids(37, seed=37)
    one(engine, system)
    total_rows = engine.cache_config.num_state_slots
    long = one(engine, system + ids(200, seed=200))
    assert long.cached == 37
    live = live_steps(engine)
    assert 37 in live and len(live) <= total_rows - 1
    assert one(engine, system + ids(5, seed=5)).cached == 37


# ---- invariants on the device side ------------------------------------------------------------------------------
@pytest.mark.parametrize('arch', ['qwen3', 'qwen3_5'])
def test_every_block_a_forward_writes_is_request_owned(model_path, arch, monkeypatch):
    path = model_path(arch)
    engine = make_engine(path, max_prefill_token_num=23)
    scheduler, pages_per_block = engine.scheduler, B // 8
    written = []

    def checked_fill(k, v, k_cache, v_cache, slot_mapping):
        trie = scheduler.trie
        blocks = set((slot_mapping // k_cache.size(1) // pages_per_block).tolist())
        node_blocks = set(trie.kv.owners())
        frozen = {ck.frozen_block_id for ck in trie.checkpoints.live()} if trie.checkpoints is not None else set()
        assert not blocks & node_blocks, f'a forward writes trie-owned blocks {blocks & node_blocks}'
        assert not blocks & frozen, f'a forward writes frozen checkpoint blocks {blocks & frozen}'
        assert blocks <= {b for seq in scheduler.running for b in seq.block_ids}
        written.append(blocks)
        return fill(k, v, k_cache, v_cache, slot_mapping)

    def checked_plans(out):
        """Copy destinations: restores land in request-owned, non-trie blocks; saves in this step's frozen blocks."""
        node_blocks = set(scheduler.trie.kv.owners())
        owned = {b for seq in out.seqs + [seq for seq, _ in out.logits_hits] for b in seq.block_ids}
        assert all(dst in owned and dst not in node_blocks for _, dst in out.kv_restores)
        assert sorted(dst for _, dst in out.kv_saves) == sorted(
            ck.frozen_block_id for _, ck in out.reserved if ck.frozen_block_id is not None)
        assert all(src in owned for src, _ in out.kv_saves)

    fill = paged_attention.fill_kv_cache
    monkeypatch.setattr(paged_attention, 'fill_kv_cache', checked_fill)  # undone before the cold control runs
    base = ids(80, seed=17)
    schedule = scheduler.schedule

    def checked_schedule():
        out = schedule()
        checked_plans(out)
        return out

    monkeypatch.setattr(scheduler, 'schedule', checked_schedule)
    runs = [one(engine, base, 4)]
    # Resumes at 46 (hybrid) / 64 (dense) although blocks 2 and 3 ([32, 64)) are cached in the trie: the
    # continuation is recomputed into private blocks (prior-art trap 4).
    runs += generate(engine, [base[:64] + ids(10, seed=18), base[:40] + ids(3, seed=19)], max_new_tokens=4)
    runs += generate(engine, [base[:64] + ids(10, seed=18) + ids(20, seed=20)] * 2, max_new_tokens=4)
    # Wave 3 (94 tokens, twice) resumes at the wave-2 prefill end 74; the second copy is admitted one step later.
    # Hybrid: by then the first copy's prompt-end checkpoint (with its logits) serves the whole prompt: only restore
    # copies and decodes write. Dense: the first copy's chunk attached block 4 ([64, 80)): 5 blocks.
    assert [r.cached for r in runs] == ([0, 46, 23, 74, 94] if arch in HYBRID else [0, 64, 32, 64, 80])
    assert len(written) > 10
    monkeypatch.undo()
    check_against_cold(path, runs, 4)


@pytest.mark.parametrize('arch', HYBRID)
def test_model_agent_orders_restores_forward_saves(model_path, arch):
    engine = make_engine(model_path(arch))
    prefix = ids(2 * B + 5, seed=21)
    one(engine, prefix)
    cache_engine, model, maker = engine.cache_engine, engine.model, engine.inputs_maker
    order, plans = [], []
    copy_blocks, copy_slots, forward, make_cache_inputs = (cache_engine.copy_logical_blocks,
                                                           cache_engine.copy_state_slots, model.forward,
                                                           maker.make_cache_inputs)

    def label(plan, kinds):
        ci = plans[-1]
        return next(kind for kind in kinds if getattr(ci, f'{kind}_plan') is not None
                    and torch.equal(getattr(ci, f'{kind}_plan'), plan.cpu()))

    def recording_make(sched):
        ci = make_cache_inputs(sched)
        plans.append(ci)
        order.append('step')
        return ci

    def blocks(plan):
        order.append(label(plan, ('kv_restore', 'kv_save')))
        copy_blocks(plan)

    def slots(plan):
        order.append(label(plan, ('state_restore', 'state_save')))
        copy_slots(plan)

    def model_forward(*args, **kwargs):
        order.append('forward')
        return forward(*args, **kwargs)

    maker.make_cache_inputs = recording_make
    cache_engine.copy_logical_blocks, cache_engine.copy_state_slots = blocks, slots
    model.forward = model_forward
    # Resumes at 37 (restore frozen block + state) and ends its prefill at 47 (save partial block + state).
    run = one(engine, prefix + ids(10, seed=22), max_new_tokens=2)
    assert run.cached == 2 * B + 5
    assert order[:6] == ['step', 'kv_restore', 'state_restore', 'forward', 'kv_save', 'state_save']
    # Every later group of copies (decode, reply checkpoint) keeps the same order.
    rank = {'kv_restore': 0, 'state_restore': 1, 'forward': 2, 'kv_save': 3, 'state_save': 4}
    groups = ' '.join(order).split('step')
    for group in groups:
        ranks = [rank[op] for op in group.split()]
        assert ranks == sorted(ranks), group


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
