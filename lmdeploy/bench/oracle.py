"""Capacity-free oracle hit rate and the attribution of prefix-cache misses to reasons.

Oracle: for request i (in submission order) the longest prefix of its prompt that is also a prefix of the tokens
some earlier request fed to the model. The tokens a request fed are its prompt and its output minus the last
sampled token: generation stops right after sampling that token, so no engine ever computed KV or a recurrent
state for it and no cache can serve it. A whole prompt counts when an earlier request fed all of it: the logits of
its last position were computed then, and an engine that keeps them (the engine's prompt-logits policy) samples
the first token without a forward. The oracle ignores memory capacity, checkpoint placement and timing (requests
in flight count as seen), so it is an upper bound on what any prefix cache could serve for the trace. A token trie
over all earlier sequences finds it in O(len(prompt)) per request.

Miss attribution, per request (all quantities in prompt tokens; q = prompt length, h = cached tokens the engine
reported, o = oracle prefix; the reasons sum to q - h):
- `novel`: q - max(o, h); tokens no earlier request had, which no cache could serve.
- the shortfall max(0, o - h) goes to exactly one reason, checked in this order:
  - `cache_off`: prefix caching was disabled for the run;
  - `multimodal`: a multimodal span boundary blocked the match (always 0 here: the workloads are text only);
  - `in_flight`: the earliest request that covers the oracle prefix had not produced its first token when this
    request was submitted (its prefill was still running, so no cache could hold it yet);
  - `evicted`: the engine evicted checkpoints or trie blocks between that source request's first token (about
    when its checkpoints were published) and this request's first token (just after its admission);
  - `capacity`: no eviction in that window, but some earlier in the run: the cache was under memory pressure,
    e.g. a checkpoint could not be reserved because no state slot was free;
  - `no_checkpoint`: the run saw no evictions at all, so the cache never held a state at a usable step (for
    hybrid models a KV match alone is no hit; the reuse needs a checkpoint at or before the shared prefix end).
  This is an approximation: it blames one reason per request and treats the eviction counters as global.
  When the engine reports `stats['miss_reasons']` itself, the runner uses that instead.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

MISS_REASONS = ('novel', 'cache_off', 'no_checkpoint', 'in_flight', 'evicted', 'capacity', 'multimodal')


class OracleHit(NamedTuple):
    num_tokens: int          # oracle prefix length (at most len(prompt))
    source: int | None       # index of the earliest earlier request covering that prefix; None when 0


class _Node:
    __slots__ = ('children', 'source')

    def __init__(self, source: int):
        self.children: dict[int, _Node] = {}
        self.source = source


class TokenTrie:
    """Prefix trie over token ids; each node remembers the first sequence that reached it."""

    def __init__(self):
        self._root = _Node(-1)

    def longest_prefix(self, tokens: Sequence[int], limit: int) -> OracleHit:
        node, depth = self._root, 0
        while depth < limit:
            child = node.children.get(tokens[depth])
            if child is None:
                break
            node, depth = child, depth + 1
        return OracleHit(depth, node.source if depth else None)

    def insert(self, tokens: Sequence[int], source: int) -> None:
        node = self._root
        for token in tokens:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node(source)
            node = child


def oracle_hits(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> list[OracleHit]:
    """Oracle prefix of every request against the fed tokens (prompt + output[:-1]) of all earlier ones
    (submission order)."""
    trie, hits = TokenTrie(), []
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        hits.append(trie.longest_prefix(prompt, len(prompt)))
        trie.insert(list(prompt) + list(output)[:-1], i)
    return hits


@dataclass(frozen=True)
class RequestTiming:
    """What the attribution needs to know about one request besides its tokens (times in seconds)."""
    submit_s: float
    first_token_s: float
    # Engine eviction counter (checkpoints + trie blocks) when this request's first token arrived.
    evictions_at_first_token: int


def attribute_misses(prompt_lens: Sequence[int], cached: Sequence[int], hits: Sequence[OracleHit],
                     timings: Sequence[RequestTiming], is_cache_enabled: bool = True) -> dict[str, int]:
    """Missed prompt tokens of the whole trace by reason (see the module docstring)."""
    totals = dict.fromkeys(MISS_REASONS, 0)
    for q, h, hit, t in zip(prompt_lens, cached, hits, timings, strict=True):
        totals['novel'] += q - max(hit.num_tokens, h)
        shortfall = max(0, hit.num_tokens - h)
        if not shortfall:
            continue
        source = timings[hit.source]
        if not is_cache_enabled:
            reason = 'cache_off'
        elif source.first_token_s > t.submit_s:
            reason = 'in_flight'
        elif t.evictions_at_first_token > source.evictions_at_first_token:
            reason = 'evicted'
        elif t.evictions_at_first_token > 0:
            reason = 'capacity'
        else:
            reason = 'no_checkpoint'
        totals[reason] += shortfall
    return totals
