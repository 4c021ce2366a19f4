"""Prefix-cache eviction under block and state pressure (`kv_lifecycle`, `checkpoint_lifecycle`).

Harness and geometry: `trie_harness.py`.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from trie_harness import SAMPLED, live, make_scheduler, make_seq, run, step, tokens

from lmdeploy.pytorch.paging.block_trie.eviction_policy import LazyMinHeap, ReusePolicy


# ---- eviction ---------------------------------------------------------------------------------------------------
def test_partial_checkpoints_and_trie_leaves_compete_in_one_order():
    # Plain LRU (the base design) to make the order readable: priority = last access tick.
    s = make_scheduler(num_blocks=16)
    run(s, make_seq(tokens(10)))                 # nodes a1 a2 + partial checkpoint at 10 (frozen block) on a2
    run(s, make_seq(tokens(8, start=100)))       # nodes b1 b2 + aligned checkpoint at 8 on b2
    run(s, make_seq(tokens(6, start=200)))       # node c1 + partial checkpoint at 6 (frozen block) on c1
    trie = s.trie
    assert trie.kv.num_nodes == 5 and s.block_manager.num_free == 16 - 5 - 2
    order = []
    while live(s) or trie.kv.num_nodes:
        kv, leaves = trie.checkpoints.evictions_by_cause['kv'], trie.kv.num_evicted
        assert trie.evict_blocks(s.block_manager.num_free + 1)
        s.check_integrity()
        if trie.kv.num_evicted > leaves:
            order.append(('leaf', trie.checkpoints.evictions_by_cause['kv_leaf']))
        else:
            assert trie.checkpoints.evictions_by_cause['kv'] == kv + 1
            order.append(('partial', len(live(s))))
    # The oldest partial checkpoint (tie with its leaf: the partial goes first, then the leaf, dead now, and its
    # parent); then the older prompt's leaf with its aligned checkpoint and its parent; the youngest partial
    # checkpoint and its leaf last.
    assert order == [('partial', 2), ('leaf', 0), ('leaf', 0), ('leaf', 1), ('leaf', 1), ('partial', 0), ('leaf', 1)]


@pytest.mark.parametrize('value_eviction, hot_survives', [(True, True), (False, False)])
def test_a_checkpoint_that_served_hits_outlives_one_off_checkpoints(value_eviction, hot_survives):
    # 6 rows: dummy + 1 running + 4 checkpoints; every checkpoint holds 1 byte (a row) in this harness.
    s = make_scheduler(num_state_slots=6, num_blocks=64, prefix_cache_value_eviction=value_eviction)
    hot = tokens(8)                              # 2 full blocks: an aligned checkpoint at 8
    run(s, make_seq(hot))
    for k in range(2):                           # two hits on it, each leaving a one-off checkpoint at 9
        follow = make_seq(hot + [50 + k])
        run(s, follow)
        assert follow.num_cached == 8
    for k in range(3):                           # three one-off prompts, each leaving a checkpoint at 6
        run(s, make_seq(tokens(6, start=100 * (k + 1))))
    assert s.trie.checkpoints.evictions_by_cause == {'state': 2}
    # By value the hot checkpoint holds 2 hits' credit against one-offs' one (log2 of 9 tokens vs of 6 or 10): two
    # one-offs went. By recency it was the least recently used after the one-offs arrived.
    again = make_seq(hot + [60])
    run(s, again)
    assert again.num_cached == (8 if hot_survives else 0)


def test_an_evicted_partial_checkpoint_leaves_its_hits_to_the_aligned_fallback():
    s = make_scheduler(num_blocks=64, prefix_cache_value_eviction=True)
    run(s, make_seq(tokens(8)))                  # aligned checkpoint at 8 on node [4, 8)
    run(s, make_seq(tokens(10)))                 # hits 8; partial checkpoint at 10 on the same node
    for k in range(2):
        run(s, make_seq(tokens(10) + [70 + k]))  # two hits on the partial one
    trie = s.trie
    aligned, partial = (next(ck for ck in live(s) if ck.step == step) for step in (8, 10))
    assert (aligned.num_hits, partial.num_hits) == (1, 2)
    assert trie.checkpoints.fallback(partial) is aligned and trie.checkpoints.fallback(aligned) is None
    before = aligned.priority
    trie.checkpoints.evict(partial, 'kv')
    s.check_integrity()
    # The requests that resumed at 10 resume at 8 now: its credit moved there, at the clock of the eviction.
    assert aligned.num_hits == 3 and aligned.priority > max(before, trie.reuse.clock)
    resumed = make_seq(tokens(10) + [90])
    run(s, resumed)
    assert resumed.num_cached == 8


def test_an_evicted_checkpoint_computed_again_inside_a_prompt_carries_its_hits_on():
    s = make_scheduler(num_blocks=64, prefix_cache_value_eviction=True, prefix_cache_branch_checkpoints=True)
    hot = tokens(8)
    run(s, make_seq(hot))                        # prompt-end checkpoint at 8
    for k in range(2):                           # two hits on it (each leaves a one-off at 9)
        run(s, make_seq(hot + [50 + k]))
    trie = s.trie
    old = next(ck for ck in live(s) if ck.step == 8)
    assert old.num_hits == 2
    trie.checkpoints.evict(old, 'state')
    # The next prompt sharing it recomputes [0, 8) and checkpoints the branch point there again: it would have hit
    # the evicted one, so the new one has its 2 hits and the one this prompt missed (a fresh branch point has 1).
    again = make_seq(hot + [60, 61])
    run(s, again)
    assert again.num_cached == 0
    new = next(ck for ck in live(s) if ck.step == 8)
    assert new is not old and new.num_hits == 3
    run(s, make_seq(tokens(8, start=100) + [2]))
    run(s, make_seq(tokens(8, start=100) + [1]))  # a branch point at 8 where nothing was evicted: its one sharer
    assert next(ck for ck in live(s) if ck.step == 8 and ck.token_ids[0] == 100).num_hits == 1
    s.check_integrity()


def test_a_reply_checkpoint_computed_again_past_the_prompt_carries_no_hits():
    # The same prompt decodes the same reply again: a checkpoint there serves the next turn, not this request.
    s = make_scheduler(num_blocks=64, prefix_cache_value_eviction=True, prefix_cache_reply_checkpoints=True)
    prompt = tokens(6)
    run(s, make_seq(prompt, max_new_tokens=3))   # prompt end at 6, reply at 8
    reply = next(ck for ck in live(s) if ck.step == 8)
    run(s, make_seq(prompt + [SAMPLED] * 2 + [7]))  # the next turn hits the reply checkpoint
    assert reply.num_hits == 1
    s.trie.checkpoints.evict(reply, 'state')
    for ck in [ck for ck in live(s) if ck.step == 6]:
        s.trie.checkpoints.evict(ck, 'state')
    run(s, make_seq(prompt, max_new_tokens=3))
    assert next(ck for ck in live(s) if ck.step == 8).num_hits == 0


@pytest.mark.parametrize('lru', [False, True])
def test_touch_prices_each_item_as_priority_does_bit_for_bit(lru):
    # touch_path prices a whole path of KV blocks with one size's terms: the values must be priority's exactly
    policy = ReusePolicy(lru=lru)
    for clock in (0.0, 1e-9, 3.7e-6):
        policy.clock = clock
        for size, nbytes in ((16, 1 << 20), (64, 3 << 19), (7, 1), (1, 0)):
            for now in (0, 3, 10 ** 6):
                items = [SimpleNamespace(num_hits=hits, last_access=-1, priority=None) for hits in (0, 1, 2, 5, 1000)]
                before = [item.num_hits for item in items]
                policy.touch(items, size, nbytes, now)
                for item, hits in zip(items, before):
                    assert item.num_hits == hits + 1 and item.last_access == now
                    assert item.priority == policy.priority(hits + 1, size, nbytes, now)


def test_lazy_min_heap_pops_the_lowest_live_eligible_entry():
    heap = LazyMinHeap()
    for name, priority in [('a', 3.0), ('b', 1.0), ('c', 2.0)]:
        heap.push(name, priority)
    heap.push('b', 5.0)                          # supersedes b's entry at 1.0
    assert heap.peek() == (2.0, 'c')
    assert heap.peek(lambda item: item != 'c') == (3.0, 'a') and heap.peek() == (2.0, 'c')
    heap.discard('c')
    assert heap.peek() == (3.0, 'a') and len(heap) == 2 and 'c' not in heap
    for k in range(500):                         # stale entries are compacted away
        heap.push('a', float(k))
    assert len(heap._heap) <= 2 * len(heap) + 65 and heap.peek() == (5.0, 'b')


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
