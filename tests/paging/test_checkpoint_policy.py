"""The checkpoint policies layered on the base design: kept logits, branch points, in-prefill cuts, replies.

Harness and geometry: `trie_harness.py`.
"""
from __future__ import annotations

from trie_harness import begin, end, live, make_scheduler, make_seq, run, step, tokens


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
    # B shares 10 tokens with a cached checkpoint tail: its first chunk stops at the branch point 10, which also
    # keeps its aligned fallback at 8 (a state cut inside the chunk, no frozen block).
    assert b.num_cached == 0
    assert [o.num_new_tokens for o in outs[:2]] == [[10], [3]]
    assert [[ck.step for _, ck in o.reserved] for o in outs[:2]] == [[8, 10], [13]]
    assert [(cut.seq, cut.step) for cut in outs[0].state_cuts] == [(b, 8)]
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
    assert (out.seqs, out.num_new_tokens, [ck.step for _, ck in out.reserved]) == ([a], [10], [8, 10])
    assert s.waiting == [b, c]
    _, ck = live(s)                              # the aligned fallback at 8, the branch point at 10
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
    # first piece ends at the branch point 10 and takes no interval cuts, only the branch point's aligned fallback
    # at 8, which is not counted against the cap (B resumes at 10 from its end checkpoint), so A's
    # two cuts land in its own tokens, at 20 and 16. C, sharing 19 tokens with A, resumes at 16 (cuts at 8 and 4
    # in the first piece would have left it only the branch point 10).
    s = make_scheduler(num_blocks=32, num_state_slots=12, prefix_cache_branch_checkpoints=True,
                       prefix_cache_prefill_state_interval=4, prefix_cache_prefill_state_cap=2)
    a, b = make_seq(tokens(10) + tokens(12, start=100)), make_seq(tokens(10) + [80, 81])
    s.add(a)
    s.add(b)
    out = step(s)
    assert (out.num_new_tokens, [ck.step for _, ck in out.reserved]) == ([10], [8, 10])
    assert [(cut.seq, cut.step) for cut in out.state_cuts] == [(a, 8)]  # the branch point's aligned fallback
    out = step(s)
    assert (out.seqs, out.num_new_tokens) == ([a, b], [12, 2])
    assert [ck.step for _, ck in out.reserved] == [20, 16, 22, 12]
    assert [(seq, cut) for seq, cut, _ in out.state_cuts] == [(a, 20), (a, 16)]
    run(s)
    c = make_seq(tokens(10) + tokens(9, start=100) + [7])
    run(s, c)
    assert (b.num_cached, c.num_cached) == (10, 16)


def test_in_prefill_cuts_keep_a_margin_from_the_piece_ends():
    # Interval 32, so the margin is 4 tokens (an eighth): a multiple of 32 closer than that to either end of a piece
    # (the checkpoint it resumed from, or the checkpoint its end takes) is no cut, so the forward can stay a graph.
    s = make_scheduler(num_blocks=64, num_state_slots=12, max_prefill_token_num=128,
                       prefix_cache_prefill_state_interval=32, prefix_cache_prefill_state_cap=2)

    def cuts_of(seq, prefix_len):
        run(s, make_seq(seq.token_ids[:prefix_len])) if prefix_len else None
        s.add(seq)
        out = step(s)
        run(s)
        assert (seq.num_cached, out.num_new_tokens) == (prefix_len, [seq.num_prompt_tokens - prefix_len])
        return [cut.step for cut in out.state_cuts]

    assert cuts_of(make_seq(tokens(66)), 0) == [32]                 # 64 lies 2 before the end: only 32
    assert cuts_of(make_seq(tokens(69, start=100)), 0) == [64, 32]  # 5 before the end: both
    assert cuts_of(make_seq(tokens(72, start=200)), 62) == []       # 64 lies 2 after the hit at 62
    assert cuts_of(make_seq(tokens(80, start=300)), 40) == [64]     # 24 after the hit, 16 before the end


def test_finished_request_leaves_a_reply_checkpoint():
    s = make_scheduler(prefix_cache_reply_checkpoints=True)
    a = make_seq(tokens(6), max_new_tokens=4)
    run(s, a)
    # Prompt end 6, and after the reply: 6 + 4 generated - 1 (the last sampled token is never fed) = 9.
    assert [ck.step for ck in live(s)] == [6, 9]
    follow = make_seq(a.token_ids + [5, 5])
    run(s, follow)
    assert follow.num_cached == 9


def test_an_unaligned_branch_point_keeps_an_aligned_fallback_for_kv_pressure():
    # The branch point at 10 (2 blocks + 2) holds a frozen block; KV pressure may take it. Its aligned fallback at 8
    # needs none, so the next sibling still resumes at 8 instead of recomputing from 0.
    s = make_scheduler(prefix_cache_branch_checkpoints=True, prefix_cache_value_eviction=True)
    run(s, make_seq(tokens(10) + [70, 71, 72]))
    run(s, make_seq(tokens(10) + [80, 81, 82]))
    fallback, branch = (next(ck for ck in live(s) if ck.step == step) for step in (8, 10))
    assert branch.num_hits == 1 and s.trie.checkpoints.fallback(branch) is fallback  # found inside a cached prompt
    s.trie.checkpoints.evict(branch, 'kv')
    assert fallback.num_hits == 1
    c = make_seq(tokens(10) + [90])
    run(s, c)
    assert c.num_cached == 8
