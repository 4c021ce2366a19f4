"""The prefix cache's paging layer alone: BlockTrie + BlockManager + StateManager driven through the Scheduler by hand.

No model runs. A "forward" is simulated the way the engine drives the scheduler: `schedule()` ->
`on_forward_done()` for every scheduled sequence -> `after_forward()` (attach, publish, unpin) -> append a sampled
token to sequences that fed their last token -> `finish()` those that are done. `check_integrity()` runs before
and after every step.

Geometry: block_size 4, so "2 full blocks + 2 tokens" is a 10-token prompt. Blocks are handed out lowest id first
and freed ids go to the back of the free list; state slots are handed out lowest first and a freed slot is the
next one handed out (row 0 is the dummy).
"""
from __future__ import annotations

import numpy as np
import pytest

from lmdeploy.pytorch.config import CacheConfig, SchedulerConfig
from lmdeploy.pytorch.messages import MultiModalSpan, SamplingParams, SchedulerSequence, SequenceStatus
from lmdeploy.pytorch.paging.block_trie import block_trie as block_trie_module
from lmdeploy.pytorch.paging.block_trie import kv_lifecycle as kv_lifecycle_module
from lmdeploy.pytorch.paging.block_trie import prefix_keys as prefix_keys_module
from lmdeploy.pytorch.paging.block_trie.node import CheckpointState, Node, NodeStateCheckpoint
from lmdeploy.pytorch.paging.block_trie.prefix_keys import PrefixHasher
from lmdeploy.pytorch.paging.scheduler import Scheduler, SchedulerOutput

BS = 4
SAMPLED = 999  # the token every simulated forward samples
# The base design: checkpoints at prefill / chunk ends (+ opt-in decode interval), matching leaves one token,
# plain LRU. The policies layered on top (each on by default in the engine) are switched on per test.
BASE = dict(prefix_cache_reply_checkpoints=False, prefix_cache_prompt_logits=False,
            prefix_cache_branch_checkpoints=False, prefix_cache_value_eviction=False)


# ---- harness ----------------------------------------------------------------------------------------------------
def make_scheduler(num_blocks: int = 16, num_state_slots: int = 8, max_prefill_token_num: int = 64,
                   max_batch_size: int = 8, hybrid: bool = True, exact: bool = True,
                   decode_interval: int = 0, **policy) -> Scheduler:
    cache = CacheConfig(block_size=BS, kernel_block_size=BS, num_blocks=num_blocks,
                        num_state_slots=num_state_slots if hybrid else 0, enable_prefix_caching=True,
                        prefix_cache_exact_steps=exact, prefix_cache_decode_state_interval=decode_interval,
                        **{**BASE, **policy})
    config = SchedulerConfig(max_batch_size=max_batch_size, max_prefill_token_num=max_prefill_token_num,
                             session_len=num_blocks * BS)
    return Scheduler(config, cache, needs_state=hybrid)


_ids = iter(range(1, 1 << 30))


def make_seq(tokens, max_new_tokens: int = 1, mm_spans: tuple[MultiModalSpan, ...] = (),
             adapter_name: str | None = None) -> SchedulerSequence:
    tokens = list(tokens)
    return SchedulerSequence(seq_id=next(_ids), token_ids=tokens, num_prompt_tokens=len(tokens),
                             sampling=SamplingParams(max_new_tokens=max_new_tokens), mm_spans=mm_spans,
                             adapter_name=adapter_name)


def begin(scheduler: Scheduler) -> SchedulerOutput:
    """The scheduling half of a step (inspect the plans, then call `end`)."""
    scheduler.check_integrity()
    out = scheduler.schedule()
    scheduler.check_integrity()
    return out


def end(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """The forward-done half of a step, in the engine's order: advance, attach / publish / unpin, sample (fed rows
    and whole-prompt hits), reply checkpoints of the finishing sequences, finish."""
    for seq, n in zip(out.seqs, out.num_new_tokens):
        scheduler.on_forward_done(seq, n)
    scheduler.after_forward(out)
    sampled = [seq for seq in out.seqs if seq.num_computed == seq.num_tokens]
    finishing = []
    for seq in sampled + [seq for seq, _ in out.logits_hits]:
        seq.token_ids.append(SAMPLED)
        if seq.num_generated >= seq.sampling.max_new_tokens:
            finishing.append(seq)
    if finishing:
        scheduler.publish_reserved(scheduler.plan_reply_checkpoints(finishing))
    for seq in finishing:
        scheduler.finish(seq, SequenceStatus.FINISHED, 'length')
    scheduler.check_integrity()
    assert_trie_consistent(scheduler)


def step(scheduler: Scheduler) -> SchedulerOutput:
    """One simulated engine step."""
    out = begin(scheduler)
    end(scheduler, out)
    return out


def run(scheduler: Scheduler, *seqs: SchedulerSequence) -> list[SchedulerOutput]:
    """Queue `seqs` and step until nothing is left; returns every step's output."""
    for seq in seqs:
        scheduler.add(seq)
    outs = []
    while scheduler.has_unfinished:
        assert len(outs) < 200, 'still busy after 200 steps (a request is never admitted?)'
        outs.append(step(scheduler))
    assert all(seq.is_finished for seq in seqs)
    return outs


def assert_trie_consistent(scheduler: Scheduler) -> None:
    """Every attached node is reachable from a root, and every published checkpoint hangs on a reachable anchor
    under its own key (so leaf eviction sees it)."""
    trie = scheduler.trie
    reachable, stack = set(), list(trie.kv.roots.values())
    while stack:
        node = stack.pop()
        assert node.attached
        for child in node.children.values():
            reachable.add(child)
            stack.append(child)
    assert len(reachable) == trie.kv.num_nodes, 'nodes attached under an evicted parent'
    if trie.checkpoints is not None:
        for ck in trie.checkpoints.live():
            if ck.published:
                assert ck.anchor.is_root or ck.anchor in reachable
                assert ck.anchor.checkpoints.get((ck.step, ck.tail_hash)) is ck


def live(scheduler: Scheduler) -> list[NodeStateCheckpoint]:
    return sorted(scheduler.trie.checkpoints.live(), key=lambda ck: ck.step)


def free_blocks(scheduler: Scheduler) -> list[int]:
    return list(scheduler.block_manager._free)


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


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
    for b, n in zip(out.seqs, out.num_new_tokens):
        s.on_forward_done(b, n)
    s.after_forward(out)
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
    for seq, n in zip(out.seqs, out.num_new_tokens):
        s.on_forward_done(seq, n)
    s.after_forward(out)
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
    s.cancel_forward(out)
    s.finish(b, SequenceStatus.ABORTED, 'error')
    assert ck.pin_count == 0 and out.reserved[0][1].state == CheckpointState.RELEASED
    assert live(s) == [ck]
    s.check_integrity()


# ---- eviction ---------------------------------------------------------------------------------------------------
def test_partial_checkpoints_are_evicted_before_trie_leaves():
    s = make_scheduler(num_blocks=16)
    run(s, make_seq(tokens(10)))                 # nodes (2 blocks) + partial checkpoint at 10 (frozen block)
    run(s, make_seq(tokens(8, start=100)))       # nodes (2 blocks) + aligned checkpoint at 8
    run(s, make_seq(tokens(6, start=200)))       # node (1 block) + partial checkpoint at 6 (frozen block)
    trie = s.trie
    assert trie.kv.num_nodes == 5 and s.block_manager.num_free == 16 - 5 - 2
    assert trie.evict_blocks(s.block_manager.num_free + 2)
    # Exactly the two frozen blocks went; no trie node was touched.
    assert trie.checkpoints.evictions_by_cause == {'kv': 2} and trie.kv.num_evicted == 0
    assert [ck.step for ck in live(s)] == [8]
    assert trie.evict_blocks(s.block_manager.num_free + 1)
    # Then the least recently used leaf (block 1 of the first prompt), no checkpoint on it.
    assert trie.kv.num_evicted == 1 and trie.checkpoints.evictions_by_cause == {'kv': 2}
    s.check_integrity()
    assert trie.evict_blocks(s.block_manager.num_free + 3)
    # ... then the leaf carrying the aligned checkpoint goes with it.
    assert trie.checkpoints.evictions_by_cause == {'kv': 2, 'kv_leaf': 1} and live(s) == []
    s.check_integrity()


def test_pinned_checkpoints_are_never_evicted():
    s = make_scheduler(num_blocks=16)
    run(s, make_seq(tokens(10)))
    run(s, make_seq(tokens(6, start=100)))
    old = live(s)[1]                             # step 10: the least recently used one
    trie = s.trie
    trie.checkpoints.pin(old, trie.tick())
    assert not trie.evict_blocks(s.block_manager.num_blocks)
    # Everything else went, the pinned one (and the nodes under it) stayed.
    assert live(s) == [old] and old.published and old.anchor.attached
    assert all(node.attached for node in [old.anchor, old.anchor.parent])
    assert not trie.evict_slot()
    trie.checkpoints.unpin(old)
    assert trie.evict_slot() and live(s) == []
    s.check_integrity()


def test_state_pressure_evicts_the_least_recently_used_checkpoint():
    # 5 rows: dummy + 4. One running request at a time takes row 1; each leaves one checkpoint behind.
    s = make_scheduler(num_state_slots=5, num_blocks=32)
    for start in (0, 100, 200):
        run(s, make_seq(tokens(6, start=start)))
    assert sorted(int(ck.token_ids[0]) for ck in live(s)) == [0, 100, 200]
    assert s.state_manager.num_free == 1
    reuse = make_seq(tokens(6, start=100) + [9, 9])  # resumes from the "100" checkpoint (pinned meanwhile)
    run(s, reuse)
    # Its checkpoint at 8 needed a row: the least recently used unpinned checkpoint ("0") went.
    assert reuse.num_cached == 6
    assert s.trie.checkpoints.evictions_by_cause == {'state': 1}
    assert sorted(int(ck.token_ids[0]) for ck in live(s)) == [100, 100, 200]
    # "100" was used after "200" was published, and the new checkpoint after that: "200" is now the LRU one.
    run(s, make_seq(tokens(6, start=300)))
    assert s.trie.checkpoints.evictions_by_cause == {'state': 2}
    assert sorted((int(ck.token_ids[0]), ck.step) for ck in live(s)) == [(100, 6), (100, 8), (300, 6)]


def test_running_request_adopts_the_trie_blocks_it_duplicates():
    # B computes the same prompt as A in the same batch, privately. When its full blocks are attached, the trie
    # already holds A's: B adopts them (one reference each) and frees its duplicates, so those nodes cannot be
    # evicted under B (otherwise they could become unevictable interior nodes over B's own blocks) and B's later
    # blocks hang off them.
    s = make_scheduler(num_blocks=8, hybrid=False)
    a, b = make_seq(tokens(8), max_new_tokens=1), make_seq(tokens(8), max_new_tokens=6)
    s.add(a)
    s.add(b)
    step(s)                                      # A: blocks [0, 1] -> trie; B computed [2, 3], then adopts [0, 1]
    assert [n.block_id for n in s.trie._paths[b.seq_id]] == [0, 1] and b.block_ids[:2] == [0, 1]
    assert s.block_manager.ref_count(0) == 2 and s.block_manager.ref_count(2) == 0
    other = make_seq(tokens(16, start=100))      # needs 4 blocks; A's nodes are held by B, so not evicted
    s.add(other)
    step(s)
    assert all(n.attached for n in s.trie._paths[b.seq_id])
    while not b.is_finished:
        step(s)
    follow = make_seq(b.token_ids[:12] + [77, 78])
    run(s, follow)
    assert follow.num_cached == 12


# ---- policies on top of the base design --------------------------------------------------------------------------
def test_identical_prompt_with_kept_logits_needs_no_forward():
    s = make_scheduler(prefix_cache_prompt_logits=True)
    run(s, make_seq(tokens(10)))
    (ck,) = live(s)
    ck.last_logits = 'logits of position 9'     # the engine keeps a host tensor; opaque to paging
    again = make_seq(tokens(10), max_new_tokens=2)
    s.add(again)
    out = begin(s)
    # Whole prompt served: nothing to feed, blocks 0, 1 shared, the partial block and the state restored, the first
    # token sampled from the kept logits.
    assert out.seqs == [] and out.logits_hits == [(again, 'logits of position 9')] and not out.is_empty
    assert again.num_cached == 10 and again.num_computed == 10 and again.block_ids[:2] == [0, 1]
    assert out.kv_restores == [(3, again.block_ids[2])] and out.state_restores == [(2, again.state_slot)]
    assert out.reserved == [] and out.pinned == [ck]
    end(s, out)
    out = step(s)                                # the sampled token is fed as a decode
    assert out.seqs == [again] and out.num_new_tokens == [1]
    run(s)
    # Without kept logits the same prompt cannot resume from its own end (one token must be computed).
    ck.last_logits = None
    other = make_seq(tokens(10))
    run(s, other)
    assert other.num_cached == 0


def test_branch_point_ends_the_first_chunk_and_becomes_a_checkpoint():
    s = make_scheduler(prefix_cache_branch_checkpoints=True)
    run(s, make_seq(tokens(10) + [70, 71, 72]))  # checkpoint at 13 only
    b = make_seq(tokens(10) + [80, 81, 82])
    outs = run(s, b)
    # B shares 10 tokens with a cached checkpoint tail: its first chunk stops at the branch point 10.
    assert b.num_cached == 0
    assert [o.num_new_tokens for o in outs[:2]] == [[10], [3]]
    assert [[ck.step for _, ck in o.reserved] for o in outs[:2]] == [[10], [13]]
    c = make_seq(tokens(10) + [90])
    run(s, c)
    assert c.num_cached == 10


def test_queued_requests_wait_for_the_branch_point_of_the_first():
    # Three prompts queued together share 10 tokens (2 blocks + 2) and nothing is cached yet. A's queued peers make
    # 10 a branch point: A's first chunk ends there and is checkpointed; B and C wait one step instead of recomputing
    # those 10 tokens beside A, then both resume at 10 while A finishes its last 3 tokens.
    s = make_scheduler(prefix_cache_branch_checkpoints=True)
    a, b, c = (make_seq(tokens(10) + tail) for tail in ([70, 71, 72], [80, 81], [90, 91, 92, 93]))
    for seq in (a, b, c):
        s.add(seq)
    out = step(s)
    assert (out.seqs, out.num_new_tokens, [ck.step for _, ck in out.reserved]) == ([a], [10], [10])
    assert s.waiting == [b, c]
    (ck,) = live(s)
    out = step(s)
    assert (out.seqs, out.num_new_tokens) == ([a, b, c], [3, 2, 4]) and out.pinned == [ck, ck]
    assert [seq.num_cached for seq in (a, b, c)] == [0, 10, 10]
    run(s)
    # Without the policy the three are admitted together, all cold.
    s = make_scheduler()
    seqs = [make_seq(tokens(10) + tail) for tail in ([70, 71, 72], [80, 81], [90, 91, 92, 93])]
    assert run(s, *seqs)[0].seqs == seqs and [seq.num_cached for seq in seqs] == [0, 0, 0]


def test_branch_point_with_queued_peers_serves_the_most_tokens():
    # A shares 8 tokens with B and C and 11 with D: a checkpoint at 8 serves 3 x 8 tokens, one at 11 only 11, so
    # A's first chunk ends at 8. B, C and D wait for it; D then finds A (running) sharing 11 and cuts its own first
    # chunk there, so a later E sharing 11 resumes at 11.
    s = make_scheduler(num_state_slots=12, prefix_cache_branch_checkpoints=True)
    a = make_seq(tokens(8) + [50, 51, 52, 53, 54])
    b, c = make_seq(tokens(8) + [60, 61]), make_seq(tokens(8) + [70, 71])
    d = make_seq(tokens(8) + [50, 51, 52, 99])
    for seq in (a, b, c, d):
        s.add(seq)
    out = step(s)
    assert (out.seqs, out.num_new_tokens, s.waiting) == ([a], [8], [b, c, d])
    out = step(s)
    assert (out.seqs, out.num_new_tokens) == ([a, b, c, d], [5, 2, 2, 3])
    assert [ck.step for _, ck in out.reserved] == [13, 10, 10, 11]
    run(s)
    assert [seq.num_cached for seq in (a, b, c, d)] == [0, 8, 8, 8]
    e = make_seq(tokens(8) + [50, 51, 52, 98, 97])
    run(s, e)
    assert e.num_cached == 11


def test_in_prefill_cuts_are_kept_for_the_tokens_past_a_branch_point():
    # In-prefill states every 4 tokens, at most 2 per prompt. A (22 tokens) and B arrive together sharing 10: A's
    # first piece ends at the branch point 10 and takes no cuts (B resumes at 10 from its end checkpoint), so A's
    # two cuts land in its own tokens, at 20 and 16. C, sharing 19 tokens with A, resumes at 16 (cuts at 8 and 4
    # in the first piece would have left it only the branch point 10).
    s = make_scheduler(num_blocks=32, num_state_slots=12, prefix_cache_branch_checkpoints=True,
                       prefix_cache_prefill_state_interval=4, prefix_cache_prefill_state_cap=2)
    a, b = make_seq(tokens(10) + tokens(12, start=100)), make_seq(tokens(10) + [80, 81])
    s.add(a)
    s.add(b)
    out = step(s)
    assert (out.num_new_tokens, [ck.step for _, ck in out.reserved], out.state_cuts) == ([10], [10], [])
    out = step(s)
    assert (out.seqs, out.num_new_tokens) == ([a, b], [12, 2])
    assert [ck.step for _, ck in out.reserved] == [20, 16, 22, 12]
    assert [(seq, cut) for seq, cut, _ in out.state_cuts] == [(a, 20), (a, 16)]
    run(s)
    c = make_seq(tokens(10) + tokens(9, start=100) + [7])
    run(s, c)
    assert (b.num_cached, c.num_cached) == (10, 16)


def test_finished_request_leaves_a_reply_checkpoint():
    s = make_scheduler(prefix_cache_reply_checkpoints=True)
    a = make_seq(tokens(6), max_new_tokens=4)
    run(s, a)
    # Prompt end 6, and after the reply: 6 + 4 generated - 1 (the last sampled token is never fed) = 9.
    assert [ck.step for ck in live(s)] == [6, 9]
    follow = make_seq(a.token_ids + [5, 5])
    run(s, follow)
    assert follow.num_cached == 9


# ---- multimodal boundaries and identity -------------------------------------------------------------------------
def test_steps_inside_a_multimodal_span_never_become_checkpoints():
    span = (MultiModalSpan(2, 7, content_hash=111),)
    s = make_scheduler(max_prefill_token_num=5)
    a = make_seq(tokens(10), mm_spans=span)
    outs = run(s, a)
    # Chunk ends at 5 (inside [2, 7): no checkpoint) and 10.
    assert [o.num_new_tokens for o in outs] == [[5], [5]]
    assert [[ck.step for _, ck in o.reserved] for o in outs] == [[], [10]]
    s = make_scheduler(max_prefill_token_num=7)
    outs = run(s, make_seq(tokens(10), mm_spans=span))
    assert [[ck.step for _, ck in o.reserved] for o in outs] == [[7], [10]]  # the span's end is a safe boundary


def test_a_match_never_resumes_inside_a_multimodal_span():
    span = (MultiModalSpan(2, 7, content_hash=111),)
    s = make_scheduler(max_prefill_token_num=7)
    run(s, make_seq(tokens(10), mm_spans=span))  # checkpoints at 7 and 10
    # Same tokens, the image spans [5, 9): step 7 lies inside it for this request and is never a resume point.
    b = make_seq(tokens(8) + [1, 2, 3], mm_spans=(MultiModalSpan(5, 9, content_hash=111),))
    run(s, b)
    assert b.num_cached == 0
    # Dense: block boundaries 4 and 8 inside a span [2, 9) cut the match back to 0.
    d = make_scheduler(hybrid=False)
    run(d, make_seq(tokens(12), mm_spans=(MultiModalSpan(2, 9, 5),)))
    b = make_seq(tokens(8) + [40, 41, 42, 43, 44], mm_spans=(MultiModalSpan(2, 9, 5),))
    run(d, b)
    assert b.num_cached == 0
    c = make_seq(tokens(12) + [40], mm_spans=(MultiModalSpan(2, 9, 5),))
    run(d, c)
    assert c.num_cached == 12                    # boundary 12 is outside the span


@pytest.mark.parametrize('hybrid', [True, False])
def test_same_tokens_with_a_different_image_do_not_match(hybrid):
    s = make_scheduler(hybrid=hybrid)
    run(s, make_seq(tokens(10), mm_spans=(MultiModalSpan(5, 7, 111),)))
    other = make_seq(tokens(10) + [1, 2, 3], mm_spans=(MultiModalSpan(5, 7, 222),))
    run(s, other)
    # Block 0 holds text only and is shared; block 1 holds the image and differs, so nothing from step 8 on (and no
    # checkpoint anchored behind it) matches.
    assert other.num_cached == (0 if hybrid else 4)
    same = make_seq(tokens(10) + [1, 2, 3], mm_spans=(MultiModalSpan(5, 7, 111),))
    run(s, same)
    assert same.num_cached == (10 if hybrid else 8)


def test_an_image_in_the_tail_is_part_of_the_checkpoint_identity():
    s = make_scheduler()
    run(s, make_seq(tokens(10), mm_spans=(MultiModalSpan(8, 10, 111),)))   # span inside the tail [8, 10)
    other = make_seq(tokens(10) + [1], mm_spans=(MultiModalSpan(8, 10, 222),))
    run(s, other)
    assert other.num_cached == 0
    same = make_seq(tokens(10) + [1], mm_spans=(MultiModalSpan(8, 10, 111),))
    run(s, same)
    assert same.num_cached == 10


def test_adapters_have_separate_caches():
    s = make_scheduler()
    run(s, make_seq(tokens(10), adapter_name='a'))
    b = make_seq(tokens(10) + [1, 2], adapter_name='b')
    run(s, b)
    assert b.num_cached == 0
    a = make_seq(tokens(10) + [1, 2], adapter_name='a')
    run(s, a)
    assert a.num_cached == 10


# ---- hash collisions --------------------------------------------------------------------------------------------
@pytest.fixture
def colliding_hashes(monkeypatch):
    """Every block hash, every tail hash and every prefix hash / block prefix key is the same constant: only exact
    verification tells prefixes apart."""
    monkeypatch.setattr(kv_lifecycle_module, 'block_hash', lambda parent, toks, mm=(): 42)
    if hasattr(block_trie_module, 'block_hash'):  # miss attribution re-hashes blocks too
        monkeypatch.setattr(block_trie_module, 'block_hash', lambda parent, toks, mm=(): 42)
    monkeypatch.setattr(block_trie_module, 'tail_hash', lambda toks, mm=(): 7)
    monkeypatch.setattr(prefix_keys_module, 'draw_multipliers', lambda rng, n: np.zeros(n, dtype=np.uint64))


@pytest.mark.parametrize('hybrid', [True, False])
def test_hash_collisions_never_give_a_false_hit(colliding_hashes, hybrid):
    s = make_scheduler(num_blocks=32, hybrid=hybrid)
    run(s, make_seq(tokens(10)))
    # First block differs: the root's only child (hash 42) is verified on tokens and rejected.
    other = make_seq(tokens(10, start=100) + [1, 2, 3])
    run(s, other)
    assert other.num_cached == 0
    # Same blocks, different tail [8, 10): the tail hash collides, the token check rejects it.
    tail = make_seq(tokens(8) + [70, 71] + [1, 2, 3])
    run(s, tail)
    assert tail.num_cached == (0 if hybrid else 8)
    # A checkpoint anchored on a colliding deeper node is not a candidate for a shorter verified path.
    branch = make_seq(tokens(4) + [60, 61, 62, 63, 64, 65])
    run(s, branch)
    assert branch.num_cached == (0 if hybrid else 4)
    # The genuine prefix still hits.
    same = make_seq(tokens(10) + [1, 2, 3])
    run(s, same)
    assert same.num_cached == (10 if hybrid else 8)


def test_colliding_checkpoints_at_one_anchor_stay_accounted(colliding_hashes):
    # Two prompts share 2 blocks and differ in the tail; both checkpoints at step 10 hang on the same node with the
    # same (step, tail hash) key. Eviction must still see every published checkpoint through its anchor.
    s = make_scheduler(num_blocks=32)
    run(s, make_seq(tokens(10)))
    run(s, make_seq(tokens(8) + [70, 71]))
    for ck in live(s):
        if ck.published:
            assert ck.anchor.checkpoints.get((ck.step, ck.tail_hash)) is ck
    assert s.trie.evict_blocks(s.block_manager.num_blocks)
    assert live(s) == [] and s.trie.kv.num_nodes == 0
    s.check_integrity()


def test_colliding_prefix_hashes_make_candidates_that_verification_rejects(colliding_hashes):
    s = make_scheduler(num_blocks=32)
    run(s, make_seq(tokens(3)))                  # checkpoint at 3 over tokens 0..2
    run(s, make_seq(tokens(2, start=50)))        # checkpoint at 2 over tokens 50, 51
    query = make_seq(tokens(6, start=50))
    # Every prefix hash collides: both checkpoints are candidates, deepest first; only the one holding the query's
    # tokens is a hit.
    cands = s.trie.checkpoint_candidates(query, max_step=5)
    assert [ck.step for ck in cands] == [3, 2]
    m = s.trie.match(query)
    assert m.num_tokens == 2 and m.checkpoint.token_ids.tolist() == [50, 51]


# ---- matching cost: cached token arrays, prefix keys, bounded walks ------------------------------------------------
def test_prefix_hashes_follow_their_definition_and_extend_like_a_fresh_computation():
    hasher = PrefixHasher(BS, seed=0)
    spans = (MultiModalSpan(3, 9, 111), MultiModalSpan(13, 14, 222))
    seq = make_seq(tokens(10, start=70), mm_spans=spans)
    hasher.block_keys(seq)                       # memoized for 10 tokens (2 full blocks)
    for t in range(11):                          # decode crosses block boundaries 12, 16 and 20
        seq.token_ids.append(100 + t)
        hasher.block_keys(seq)
    n = len(seq.token_ids)
    steps = np.arange(n + 1)
    # H(s) = sum_{j < s} token[j] * V[j // stride] * S[j % stride] mod 2**64
    g = hasher.stride
    mult = [int(hasher._chunk_multipliers(n // g + 1)[j // g]) * int(hasher._offset_mult[j % g]) for j in range(n)]
    expected = [sum(t * m for t, m in zip(seq.token_ids[:i], mult[:i])) % 2**64 for i in range(n + 1)]
    assert hasher.prefix_hashes(seq, steps).tolist() == expected
    assert hasher.chunk_hashes(seq).tolist() == expected[::g]
    fresh = make_seq(list(seq.token_ids), mm_spans=spans)
    assert np.array_equal(hasher.block_keys(seq), hasher.block_keys(fresh))
    assert len(hasher.block_keys(seq)) == n // BS + 1
    # The multimodal identity of the prefix is part of the key from the first block overlapping an image on.
    other = make_seq(list(seq.token_ids), mm_spans=(MultiModalSpan(3, 9, 333), MultiModalSpan(13, 14, 222)))
    assert (hasher.block_keys(fresh) == hasher.block_keys(other)).tolist() == [True] + [False] * 5
    seq.token_ids[5] = 0                         # not an append: noticed only if the last token changes ...
    seq.token_ids.append(1)
    seq.token_ids = list(seq.token_ids)          # ... or the list is replaced, which rebuilds array and memo
    fresh = make_seq(list(seq.token_ids), mm_spans=spans)
    assert np.array_equal(hasher.prefix_hashes(seq, steps), hasher.prefix_hashes(fresh, steps))
    assert np.array_equal(hasher.block_keys(seq), hasher.block_keys(fresh))


def test_prefix_hashes_with_chunks_smaller_than_blocks():
    hasher = PrefixHasher(block_size=48, seed=1)   # hash chunks of gcd(48, 16) = 16 tokens, 3 per block
    seq = make_seq(tokens(100, start=5))
    g, n = hasher.stride, 100
    mult = [int(hasher._chunk_multipliers(n // g + 1)[j // g]) * int(hasher._offset_mult[j % g]) for j in range(n)]
    expected = [sum(t * m for t, m in zip(seq.token_ids[:i], mult[:i])) % 2**64 for i in range(n + 1)]
    assert g == 16 and hasher.prefix_hashes(seq, np.arange(n + 1)).tolist() == expected
    assert len(hasher.block_keys(seq)) == 100 // 48 + 1


@pytest.mark.parametrize('hybrid', [True, False])
def test_match_walks_no_block_before_the_hit(monkeypatch, hybrid):
    s = make_scheduler(num_blocks=64, hybrid=hybrid)
    run(s, make_seq(tokens(41)))                 # 10 full blocks + 1 token; hybrid: checkpoint at 41
    calls = []
    find_child = s.trie.kv.find_child
    monkeypatch.setattr(s.trie.kv, 'find_child', lambda *args: calls.append(1) or find_child(*args))
    query = make_seq(tokens(41) + [500, 501])
    m = s.trie.match(query)
    assert m.num_tokens == (41 if hybrid else 40) and len(m.nodes) == 10
    # Hybrid: the checkpoint's recorded path; dense: binary search on block prefix keys. At most the one exact
    # lookup past the cached run, never a walk over the prompt's blocks.
    assert len(calls) <= 1


def test_a_repeated_match_drops_evicted_nodes_it_verified_before():
    s = make_scheduler(num_blocks=32, hybrid=False)
    run(s, make_seq(tokens(13)))                 # 3 full blocks + 1 token: 3 trie nodes
    query = make_seq(tokens(13) + [1])
    assert s.trie.match(query).num_tokens == 12  # the verified run is memoized on the request
    assert s.trie._evict_leaf()                  # the deepest node goes
    m = s.trie.match(query)
    assert m.num_tokens == 8 and all(node.attached for node in m.nodes)
    run(s, make_seq(tokens(13)))                 # block 2 cached again, as a new node
    m = s.trie.match(query)
    assert m.num_tokens == 12 and all(node.attached for node in m.nodes)


def test_longest_continuation_equals_brute_force():
    rng = np.random.default_rng(0)
    node = Node(block_id=None, token_ids=np.zeros(0, dtype=np.int64), hash=0, depth=0)
    keys = [rng.integers(0, 3, int(rng.integers(1, 6))).tobytes() for _ in range(60)]
    live_keys = list(keys)
    for key in keys:
        node.add_continuation(key)
    for key in keys[::3]:                        # duplicates included: one copy goes each time
        node.remove_continuation(key)
        live_keys.remove(key)
    live_keys = [np.frombuffer(k, np.int64) for k in live_keys]

    def lcp(a, b):
        m = min(len(a), len(b))
        same = a[:m] == b[:m]
        return m if same.all() else int(same.argmin())

    assert sorted(node.continuations) == node.continuations
    for _ in range(300):
        query = rng.integers(0, 3, int(rng.integers(0, 6)))
        assert node.longest_continuation(query.tobytes()) == max((lcp(query, k) for k in live_keys), default=0)


def test_integrity_check_catches_a_checkpoint_whose_path_is_gone():
    s = make_scheduler()
    run(s, make_seq(tokens(10)))
    ck = live(s)[0]
    ck.anchor.attached = False                   # what matching must never see: a published checkpoint off the trie
    with pytest.raises(AssertionError, match='lost its path'):
        s.check_integrity()
    ck.anchor.attached = True
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
