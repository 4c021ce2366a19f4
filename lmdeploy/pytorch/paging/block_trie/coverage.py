"""What a prompt shares with the cache and with requests in flight past its hit: branch points and miss reasons.

`BlockTrie.match` finds the hit (checkpoint and cached blocks); this module looks only past it:
- `cached`: how far the prompt runs on in the trie (the matched blocks plus the longest common prefix with a child
  block or checkpoint tail of the last matched node, found by binary search in its sorted continuations), and how
  far a run of evicted blocks reaches after that;
- `in_flight`: the common prefix with sequences in flight or queued that serves the most tokens;
- `junction`: where the prompt diverges from them, a branch point to checkpoint (never strictly inside an image);
- `attribute`: the reasons for the prompt tokens past the hit (`MissTracker`), including tokens cached only under
  another adapter.
Owns nothing; reads the trie, its sequences' canonical paths and the miss memories.
"""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from ...messages import SchedulerSequence
from .node import Node
from .prefix_keys import common_prefix

if TYPE_CHECKING:
    from .block_trie import BlockTrie


def _common_nodes(a: list[Node], b: list[Node]) -> int:
    """Leading nodes two root paths share (by identity; shared nodes form a prefix of both)."""
    lo, hi = 0, min(len(a), len(b))
    if hi and a[hi - 1] is b[hi - 1]:
        return hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] is b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PromptCoverage:

    def __init__(self, trie: BlockTrie):
        self.trie = trie
        self.block_size = trie.block_size
        self.kv = trie.kv
        self.hasher = trie.hasher
        self.misses = trie.misses
        self.exact_steps = trie.exact_steps
        self.prompt_logits = trie.prompt_logits

    def cached(self, seq: SchedulerSequence, tokens: np.ndarray, path: list[Node]) -> tuple[int, int]:
        """(tokens of the prompt present in the trie: matched blocks plus the longest common prefix with a child
        block or a checkpoint tail of the last matched node; the end of a run of evicted blocks after that)."""
        bs, base = self.block_size, len(path) * self.block_size
        parent = path[-1] if path else self.kv.root(seq.adapter_name)
        covered = base + parent.longest_continuation(tokens[base:base + bs].tobytes())
        evicted_until = base
        if covered == base:
            keys, depth = self.hasher.block_keys(seq), len(path)
            while depth + 1 < len(keys) and int(keys[depth + 1]) in self.misses.evicted_blocks:
                depth += 1
            evicted_until = depth * bs
        return min(covered, len(tokens)), evicted_until

    def in_flight(self, seq: SchedulerSequence, tokens: np.ndarray, path: list[Node], peers, hit: int) -> int:
        """The branch point shared with in-flight or queued sequences of the same adapter: among their common
        prefixes with this prompt deeper than `hit`, the one serving the most tokens (its length times the peers
        reaching it), the deeper on a tie. A peer holding the whole prompt is left out when the prompt-end
        checkpoint serves it (it is longer, or identical with kept logits).

        Each common prefix is exact and costs O(1) for a peer sharing too little (one token), else the blocks it
        shares with the prompt's cached run through its own canonical trie path (node identity, binary search)
        plus a token comparison of the rest, which is the part not yet in the trie."""
        n = len(tokens)
        need = max(hit + 1, min(self.block_size, n))  # a peer counts from this many shared tokens on
        if need > n:
            return 0
        ids, lcps = seq.token_ids, []
        for peer in peers:
            other = peer.token_ids
            if (peer is seq or peer.adapter_name != seq.adapter_name or len(other) < need
                    or other[need - 1] != ids[need - 1]):
                continue
            shared = _common_nodes(path, self.trie.path_of(peer.seq_id)) * self.block_size
            if shared < min(n, len(other)) and other[shared] != ids[shared]:
                lcp = shared
            else:
                lcp = common_prefix(tokens, peer.token_array(), start=shared)
            if lcp >= need and not (lcp == n and (self.prompt_logits or peer.num_tokens > lcp)):
                lcps.append(lcp)
        lcps.sort(reverse=True)
        return max(((lcp * (i + 1), lcp) for i, lcp in enumerate(lcps)), default=(0, 0))[1]

    def junction(self, seq: SchedulerSequence, covered: int, hit: int) -> int:
        """Where this prompt diverges from cached ones (a branch point to checkpoint), or 0."""
        junction = min(covered, seq.num_tokens - 1)
        if not self.exact_steps:
            junction -= junction % self.block_size
        while junction > hit:
            # Every step in (start, junction] of a span containing the junction is inside it: jump to its start.
            starts = [span.start for span in seq.mm_spans if span.start < junction < span.end]
            if not starts:
                break
            junction = min(starts)
        return junction if junction > hit else 0

    def attribute(self, seq: SchedulerSequence, tokens: np.ndarray, path: list[Node], hit: int, covered: int,
                   evicted_until: int, mm_limited: int, routes_limited: int = 0) -> Counter:
        bs = self.block_size
        first, last = hit // bs, min(covered, len(tokens)) // bs
        gap_anchors = self.hasher.block_keys(seq)[first:min(last, len(path)) + 1].tolist()
        other = self._other_adapter(seq, tokens) if len(self.kv.roots) > 1 else 0
        return self.misses.attribute(len(tokens), hit, covered, evicted_until, mm_limited, gap_anchors, other,
                                     routes_limited)

    def _other_adapter(self, seq: SchedulerSequence, tokens: np.ndarray) -> int:
        """Leading prompt tokens the trie holds under another adapter's root (its cached run of blocks, found by
        binary search on that adapter's block prefix keys and verified, plus the longest continuation after it):
        what the `adapter` miss reason counts. Attribution only; a hit never reads another root."""
        bs, max_depth, best = self.block_size, len(tokens) // self.block_size, 0
        for adapter, root in self.kv.roots.items():
            if adapter == seq.adapter_name:
                continue
            keys, found, lo, hi = self.hasher.block_keys_under(seq, adapter), root, 1, max_depth
            while lo <= hi:
                mid = (lo + hi) // 2
                node = self.kv.lookup(int(keys[mid]))
                if node is None or node.depth != mid or node.adapter_name != adapter:
                    hi = mid - 1
                else:
                    found, lo = node, mid + 1
            if found is not root and not self.trie.verified_run(seq, tokens, [], found, top=root):
                found = root
            base = found.depth * bs
            best = max(best, base + found.longest_continuation(tokens[base:base + bs].tobytes()))
        return min(best, len(tokens))
