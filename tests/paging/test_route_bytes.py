"""`BlockTrie.routes_bytes` is a running count (kept where routes are attached and where their block or checkpoint is
evicted): after a random run of requests sharing prefixes, chunked, aborted and evicted under KV and state pressure,
it equals a full walk of the trie and its checkpoints after every step (`route_store.bytes_held`)."""
from __future__ import annotations

import random

import numpy as np
import pytest
from trie_harness import begin, end, make_scheduler, make_seq

from lmdeploy.pytorch.paging.block_trie import route_store
from lmdeploy.pytorch.routed_experts import ROUTE_DTYPE, RoutedExperts

LAYERS, TOP_K = 2, 3


def rows_of(tokens: list[int]) -> np.ndarray:
    """The "router": a pure function of each token, so rows replayed from the cache equal recomputed ones."""
    t = np.asarray(tokens, dtype=np.int64)[:, None, None]
    return ((t * np.arange(1, LAYERS * TOP_K + 1).reshape(1, LAYERS, TOP_K)) % 61).astype(ROUTE_DTYPE)


def walk(trie) -> int:
    live = trie.checkpoints.live() if trie.checkpoints is not None else []
    return route_store.bytes_held(trie.kv.roots.values(), live)


def forward(out) -> None:
    """What the engine's forward does for routes: each fed position's rows, written before the sequence advances."""
    for seq, n in zip(out.seqs, out.num_new_tokens):
        seq.routed_experts.write(seq.num_computed, rows_of(seq.token_ids[seq.num_computed:seq.num_computed + n]))


@pytest.mark.parametrize('seed', range(4))
def test_route_bytes_equal_a_full_walk_through_inserts_and_evictions(seed):
    rng = random.Random(seed)
    scheduler = make_scheduler(num_blocks=20, num_state_slots=6, max_prefill_token_num=12, max_batch_size=4,
                               prefix_cache_reply_checkpoints=True, decode_interval=4)
    trie = scheduler.trie
    stems = [[rng.randrange(1, 50) for _ in range(rng.randrange(3, 14))] for _ in range(4)]
    live, seen_bytes, tails = [], set(), 0
    for _ in range(160):
        if len(live) < 6 and rng.random() < 0.5:
            seq = make_seq(rng.choice(stems) + [rng.randrange(1, 50) for _ in range(rng.randrange(0, 9))],
                           max_new_tokens=rng.randrange(1, 7))
            seq.routed_experts = RoutedExperts(LAYERS, TOP_K)
            scheduler.add(seq)
            live.append(seq)
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            if not victim.is_finished:
                scheduler.abort(victim)
        out = begin(scheduler)
        forward(out)
        end(scheduler, out)  # check_integrity compares the count with a walk too
        assert trie.routes_bytes() == walk(trie)
        seen_bytes.add(trie.routes_bytes())
        tails = max(tails, sum(ck.routes_tail is not None for ck in trie.checkpoints.live()))
        live = [seq for seq in live if not seq.is_finished]
    # the run exercised what it is about: routes of blocks and of partial tails came and went
    assert trie.kv.num_evicted > 0 and trie.checkpoints.num_evicted > 0
    assert len(seen_bytes) > 10 and max(seen_bytes) > 0
    assert tails > 0
