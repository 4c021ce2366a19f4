"""BlockTrie match, save and restore plans through the Scheduler (dense blocks, hybrid checkpoints, copy plans).

Harness and geometry: `trie_harness.py`.
"""
from __future__ import annotations

import numpy as np
import pytest
from trie_harness import begin, end, free_blocks, live, make_scheduler, make_seq, run, step, tokens

from lmdeploy.pytorch.messages import SequenceStatus
from lmdeploy.pytorch.paging.block_trie.node import CheckpointState


# ---- dense: whole KV blocks -------------------------------------------------------------------------------------
def test_dense_hit_shares_full_blocks_and_leaves_one_token():
    s = make_scheduler(hybrid=False)
    a = make_seq(tokens(10))                     # 2 full blocks + 2 tokens -> blocks [0, 1, 2]
    (out,) = run(s, a)
    assert out.num_new_tokens == [10] and a.num_cached == 0
    assert s.trie.kv.num_nodes == 2              # the two full blocks, trie-owned now; block 2 freed
    assert free_blocks(s) == list(range(3, 16)) + [2]
    b = make_seq(tokens(10) + [50, 51, 52])       # shares blocks 0, 1; block 2's tokens differ
    s.add(b)
    out = begin(s)
    assert b.num_cached == 8 and b.block_ids == [0, 1, 3, 4] and out.num_new_tokens == [5]
    assert not (out.kv_restores or out.state_restores or out.kv_saves or out.state_saves)
    end(s, out)


def test_dense_identical_prompt_reuses_all_but_the_last_block():
    s = make_scheduler(hybrid=False)
    run(s, make_seq(tokens(8)))                  # exactly 2 blocks
    again = make_seq(tokens(8))
    s.add(again)
    out = begin(s)
    # (8 - 1) // 4 = 1 block: block 1 holds the last prompt token, which must be computed for the logits.
    assert again.num_cached == 4 and again.block_ids == [0, 2] and out.num_new_tokens == [4]
    end(s, out)


# ---- hybrid: checkpoints, save and restore plans ----------------------------------------------------------------
def test_partial_checkpoint_reserves_slot_and_frozen_block_then_publishes():
    s = make_scheduler()
    a = make_seq(tokens(10))
    s.add(a)
    out = step(s)
    # A: blocks [0, 1, 2], runtime slot 1. Checkpoint at step 10 = 2 blocks + 2 tokens: slot 2, frozen block 3.
    assert out.kv_saves == [(2, 3)] and out.state_saves == [(1, 2)]
    assert out.kv_restores == [] and out.state_restores == [] and out.pinned == []
    ((seq, ck),) = out.reserved
    assert seq is a and (ck.step, ck.slot, ck.frozen_block_id) == (10, 2, 3)
    assert ck.state == CheckpointState.PUBLISHED and ck.pin_count == 0
    assert ck.block_ids == (0, 1) and ck.anchor.block_id == 1 and ck.anchor.depth == 2
    assert np.array_equal(ck.token_ids, tokens(10))
    assert s.trie.num_checkpoints == 1 and s.trie.stats.checkpoints_saved == 1


def test_partial_checkpoint_restores_into_a_private_block():
    s = make_scheduler()
    run(s, make_seq(tokens(10)))                 # checkpoint at 10: slot 2, frozen block 3; blocks 0, 1 in the trie
    (ck,) = live(s)
    b = make_seq(tokens(10) + [50, 51, 52])
    s.add(b)
    out = begin(s)
    # B shares blocks 0, 1 (tokens [0, 8)); its block 2 is a new private block (4) that receives the frozen copy of
    # tokens [8, 10); it computes [10, 13) and saves a new partial checkpoint at 13 from its block 3 (5) into
    # frozen block 6 and slot 3.
    assert b.num_cached == 10 and b.block_ids == [0, 1, 4, 5] and b.state_slot == 1
    assert out.num_new_tokens == [3]
    assert out.kv_restores == [(3, 4)] and out.state_restores == [(2, 1)]
    assert out.kv_saves == [(5, 6)] and out.state_saves == [(1, 3)]
    assert out.pinned == [ck] and ck.pin_count == 1
    assert s.block_manager.ref_count(4) == 1 and s.block_manager.ref_count(3) == 1  # private dst, frozen src
    end(s, out)
    assert ck.pin_count == 0 and s.trie.checkpoints.is_evictable(ck)
    assert [c.step for c in live(s)] == [10, 13]


def test_aligned_checkpoint_has_no_frozen_block():
    s = make_scheduler()
    a = make_seq(tokens(8))
    s.add(a)
    out = step(s)
    assert out.kv_saves == [] and out.state_saves == [(1, 2)]
    (ck,) = live(s)
    assert ck.step == 8 and ck.frozen_block_id is None and not ck.is_partial
    run(s)
    b = make_seq(tokens(8) + [50, 51])
    s.add(b)
    out = begin(s)
    # Resume at 8 = 2 full blocks: only the state is restored (checkpoint slot 2 -> runtime slot 1); blocks 0, 1 are
    # shared, block 2 is private; the new prefill end 10 saves a partial checkpoint (frozen block 3, slot 3).
    assert b.num_cached == 8 and b.block_ids == [0, 1, 2] and b.state_slot == 1
    assert out.kv_restores == [] and out.state_restores == [(2, 1)]
    assert out.kv_saves == [(2, 3)] and out.state_saves == [(1, 3)]
    end(s, out)


def test_aligned_mode_checkpoints_only_block_multiples():
    s = make_scheduler(exact=False)
    out = run(s, make_seq(tokens(10)))[0]
    assert out.reserved == [] and live(s) == []
    out = run(s, make_seq(tokens(12, start=100)))[0]
    assert [ck.step for _, ck in out.reserved] == [12]
    # 'exact' would resume the second turn at 10; 'aligned' has nothing to resume from.
    b = make_seq(tokens(10) + [7, 7, 7])
    run(s, b)
    assert b.num_cached == 0


def test_identical_prompt_never_resumes_from_its_own_end_checkpoint():
    # Matching leaves one token to compute (limit n - 1), and the only checkpoint of a one-chunk prompt is at n:
    # an identical hybrid prompt reuses nothing (prior-art trap 2). Dense models still reuse (n - 1) // B blocks.
    s = make_scheduler()
    run(s, make_seq(tokens(10)))
    again = make_seq(tokens(10))
    run(s, again)
    assert again.num_cached == 0
    # With chunked prefill an earlier chunk-end checkpoint serves the repeat.
    s = make_scheduler(max_prefill_token_num=6)
    run(s, make_seq(tokens(10)))
    again = make_seq(tokens(10))
    run(s, again)
    assert again.num_cached == 6


def test_chunk_ends_become_checkpoints_mid_block():
    s = make_scheduler(max_prefill_token_num=6)
    a = make_seq(tokens(15))
    outs = run(s, a)
    # Chunks [0, 6), [6, 12), [12, 15): steps 6 (1 block + 2), 12 (3 blocks, aligned), 15 (3 blocks + 3).
    assert [o.num_new_tokens for o in outs] == [[6], [6], [3]]
    assert [[ck.step for _, ck in o.reserved] for o in outs] == [[6], [12], [15]]
    assert [(ck.step, ck.is_partial, len(ck.block_ids)) for ck in live(s)] == [(6, True, 1), (12, False, 3),
                                                                               (15, True, 3)]
    # Each partial save copies A's block holding the step (block index 1, then 3) into a fresh frozen block.
    assert outs[0].kv_saves == [(1, 2)] and outs[1].kv_saves == [] and outs[2].kv_saves == [(4, 5)]


@pytest.mark.parametrize('shared, expected', [(5, 0), (7, 6), (13, 12), (15, 15)])
def test_match_takes_the_deepest_verified_checkpoint(shared, expected):
    s = make_scheduler(max_prefill_token_num=6)
    run(s, make_seq(tokens(15)))                 # checkpoints at 6, 12, 15
    b = make_seq(tokens(shared) + tokens(5, start=500))
    run(s, b)
    assert b.num_cached == expected


def test_three_branches_restore_one_checkpoint_in_one_forward():
    s = make_scheduler(num_blocks=32, num_state_slots=10)
    run(s, make_seq(tokens(10)))                 # checkpoint at 10: slot 2, frozen block 3
    (ck,) = live(s)
    branches = [make_seq(tokens(10) + tokens(k, start=100 * k)) for k in (1, 2, 3)]
    for b in branches:
        s.add(b)
    out = s.schedule()
    s.check_integrity()
    assert out.seqs == branches and [b.num_cached for b in branches] == [10, 10, 10]
    assert ck.pin_count == 3 and out.pinned == [ck, ck, ck]
    # One source, three distinct private destinations (block index 2 of each branch) and runtime slots.
    assert out.kv_restores == [(3, b.block_ids[2]) for b in branches]
    assert out.state_restores == [(2, b.state_slot) for b in branches]
    assert len({dst for _, dst in out.kv_restores}) == 3 and 3 not in [b.block_ids[2] for b in branches]
    s.release(s.commit(out, s.update(out, [])))  # the forward samples nothing here
    assert ck.pin_count == 0
    s.check_integrity()


def test_branches_without_a_prefix_request_share_blocks_but_not_state():
    # Each request's only checkpoint lies in its own unique tokens, so hybrid siblings never hit although their KV
    # blocks are shared (no branch-point capture; prior-art trap 1). A dense model reuses the 2 shared blocks.
    hybrid, dense = make_scheduler(), make_scheduler(hybrid=False)
    for s, expected in ((hybrid, [0, 0, 0]), (dense, [0, 8, 8])):
        seqs = [make_seq(tokens(10) + tokens(3, start=100 * k)) for k in (1, 2, 3)]
        for seq in seqs:
            run(s, seq)
        assert [seq.num_cached for seq in seqs] == expected


def test_same_prefix_twice_in_one_batch_publishes_once():
    s = make_scheduler()
    a, b = make_seq(tokens(10)), make_seq(tokens(10))
    s.add(a)
    s.add(b)
    out = s.schedule()
    # Both cold: A blocks [0, 1, 2] slot 1, B blocks [3, 4, 5] slot 2; checkpoints A (slot 3, frozen 6), B (slot 4,
    # frozen 7) are both reserved because neither is published yet.
    assert (a.block_ids, b.block_ids, a.state_slot, b.state_slot) == ([0, 1, 2], [3, 4, 5], 1, 2)
    assert out.kv_saves == [(2, 6), (5, 7)] and out.state_saves == [(1, 3), (2, 4)]
    s.release(s.commit(out, s.update(out, [])))
    # A's blocks became the trie nodes; B's path deduplicates onto them and B's checkpoint is released.
    (ck,) = live(s)
    assert (ck.slot, ck.frozen_block_id, ck.block_ids) == (3, 6, (0, 1))
    assert [n.block_id for n in s.trie._paths[b.seq_id]] == [0, 1]
    assert 7 in free_blocks(s) and 4 not in s.state_manager._used
    s.check_integrity()
    for seq in (a, b):
        s.finish(seq, SequenceStatus.FINISHED, 'length')
    s.check_integrity()
    later = make_seq(tokens(10) + [1, 2])
    run(s, later)
    assert later.num_cached == 10


def test_decode_interval_checkpoints_are_block_aligned():
    s = make_scheduler(decode_interval=8)
    a = make_seq(tokens(6), max_new_tokens=12)
    outs = run(s, a)
    # prefill end 6; decodes feed positions 6..16 (steps 7..17); steps 8 and 16 are on the interval.
    steps = [ck.step for o in outs for _, ck in o.reserved]
    assert steps == [6, 8, 16]
    assert [ck.is_partial for ck in live(s)] == [True, False, False]
    follow = make_seq(a.token_ids + [5, 5])
    run(s, follow)
    assert follow.num_cached == 16


def test_failed_forward_releases_reservations_and_pins():
    s = make_scheduler()
    run(s, make_seq(tokens(10)))
    (ck,) = live(s)
    b = make_seq(tokens(10) + [1, 2, 3])
    s.add(b)
    out = s.schedule()
    assert ck.pin_count == 1 and len(out.reserved) == 1
    assert s.cancel(out) == [b] and b.status == SequenceStatus.ABORTED and b.finish_reason == 'error'
    assert ck.pin_count == 0 and out.reserved[0][1].state == CheckpointState.RELEASED
    assert live(s) == [ck]
    s.check_integrity()

# ---- copy plans -------------------------------------------------------------------------------------------------
def test_copy_plans_carry_validated_physical_offsets():
    torch = pytest.importorskip('torch')
    from lmdeploy.pytorch.engine.cache_inputs import CacheCheckpointInputs, validate_copy_plan
    s = make_scheduler()
    bm = s.block_manager
    bm.allocate(6)                               # blocks 0..5 allocated
    ci = CacheCheckpointInputs.build([(3, 4)], [(2, 1)], [(5, 0)], [(1, 3)], bm.resolve_gpu_block_offsets)
    assert torch.equal(ci.kv_restore_plan, torch.tensor([[3], [4]]))
    assert torch.equal(ci.state_save_plan, torch.tensor([[1], [3]]))
    with pytest.raises(ValueError, match='duplicate destinations'):
        CacheCheckpointInputs.build([(1, 4), (2, 4)], [], [], [], bm.resolve_gpu_block_offsets)
    with pytest.raises(ValueError, match='overlap sources'):
        CacheCheckpointInputs.build([], [], [(1, 2), (2, 3)], [], bm.resolve_gpu_block_offsets)
    with pytest.raises(ValueError, match='duplicate destinations'):
        CacheCheckpointInputs.build([], [(2, 1), (3, 1)], [], [], bm.resolve_gpu_block_offsets)
    with pytest.raises(ValueError, match='not allocated'):
        CacheCheckpointInputs.build([(3, 9)], [], [], [], bm.resolve_gpu_block_offsets)
    with pytest.raises(ValueError, match='out of range'):
        CacheCheckpointInputs.build([(3, 99)], [], [], [], bm.resolve_gpu_block_offsets)
    validate_copy_plan(np.array([[1, 1], [2, 3]]), 'plan')  # a shared source is fine


def test_integrity_check_catches_a_leaked_reference():
    s = make_scheduler()
    run(s, make_seq(tokens(10)))
    s.block_manager.add_ref([0])
    with pytest.raises(AssertionError, match='KV ref counts'):
        s.check_integrity()
    s.block_manager.free([0])
    slot = s.state_manager.allocate()
    with pytest.raises(AssertionError, match='state slots'):
        s.check_integrity()
    s.state_manager.free(slot)
    s.check_integrity()


def test_identical_prompts_served_from_kept_logits_count_toward_the_batch_size():
    # Three identical prompts after the first: each would need no forward, but admission still respects
    # max_batch_size (regression: logits hits used to be admitted without limit).
    s = make_scheduler(max_batch_size=1, prefix_cache_prompt_logits=True)
    run(s, make_seq(tokens(10)))
    (ck,) = live(s)
    ck.last_logits = 'logits of position 9'
    for _ in range(3):
        s.add(make_seq(tokens(10), max_new_tokens=2))
    out = begin(s)
    assert len(out.logits_hits) == 1 and not out.seqs
    assert len(s.running) == 1 and len(s.waiting) == 2
