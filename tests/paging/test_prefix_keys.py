"""Prefix identity and matching cost: multimodal spans, adapters, hash collisions, prefix keys, bounded walks.

Harness and geometry: `trie_harness.py`.
"""
from __future__ import annotations

import numpy as np
import pytest
from trie_harness import BS, live, make_scheduler, make_seq, run, tokens

from lmdeploy.pytorch.messages import MultiModalSpan
from lmdeploy.pytorch.paging.block_trie import block_trie as block_trie_module
from lmdeploy.pytorch.paging.block_trie import kv_lifecycle as kv_lifecycle_module
from lmdeploy.pytorch.paging.block_trie import prefix_keys as prefix_keys_module
from lmdeploy.pytorch.paging.block_trie.node import Node
from lmdeploy.pytorch.paging.block_trie.prefix_keys import PrefixHasher


# ---- multimodal boundaries and identity -------------------------------------------------------------------------
def test_steps_inside_a_multimodal_span_never_become_checkpoints():
    span = (MultiModalSpan(2, 7, content_hash=111),)
    s = make_scheduler(max_prefill_token_num=5)
    a = make_seq(tokens(10), mm_spans=span)
    outs = run(s, a)
    # A 5-token chunk would end at 5, inside [2, 7): it stops before the image (2), the image goes whole (7, the
    # last image's end, checkpointed), then the rest (10).
    assert [o.num_new_tokens for o in outs] == [[2], [5], [3]]
    assert [[ck.step for _, ck in o.reserved] for o in outs] == [[2], [7], [10]]
    # An image longer than the budget is still fed whole, from its start.
    outs = run(make_scheduler(max_prefill_token_num=3), make_seq(tokens(10), mm_spans=span))
    assert [o.num_new_tokens for o in outs] == [[2], [5], [3]]
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
    # checkpoint anchored behind it) matches. Hybrid: the image's end (7) is a checkpointed chunk end, whose aligned
    # fallback at its block floor (4, before the image) is text only and serves the other image's request.
    assert other.num_cached == 4
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
    assert s.trie.eviction.evict_lowest_leaf()   # the deepest node goes
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
