"""Where prefix caching takes state checkpoints, end to end on tiny CPU engines: exact-step checkpoints against
block-aligned ones on a multi-turn chat, decode checkpoints every `prefix_cache_decode_state_interval` tokens, and
in-prefill checkpoints (cuts inside a prefill chunk, on free state rows only); every hit is exact and warm == cold."""
from __future__ import annotations

import pytest
from prefix_cache_runs import (
    BASE,
    HYBRID,
    NO_REPLY,
    B,
    Run,
    assert_warm_equals_cold,
    check_against_cold,
    ids,
    live_steps,
    make_engine,
    one,
)

from lmdeploy.pytorch.engine.engine import Engine


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
