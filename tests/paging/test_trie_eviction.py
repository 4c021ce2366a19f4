"""Prefix-cache eviction under block and state pressure (`kv_lifecycle`, `checkpoint_lifecycle`).

Harness and geometry: `trie_harness.py`.
"""
from __future__ import annotations

from trie_harness import live, make_scheduler, make_seq, run, step, tokens


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
