"""Prefix hashes of a request's tokens, computed in vectorised passes and memoized on the request.

`PrefixHasher` cuts tokens into chunks of `stride` tokens (`gcd(block_size, 16)`) and draws secret random odd 64-bit
multipliers: `S[j]` per offset in a chunk and `V[c]` per chunk index (grown on demand). With
`w[c] = sum_j token[c * stride + j] * S[j]` (one integer matrix-vector product over the chunks, no large
temporaries), the hash of the prefix `[0, s)`, `s = c * stride + r`, is (mod 2**64)

    H(s) = sum_{c' < c} V[c'] * w[c']  +  V[c] * sum_{j < r} token[c * stride + j] * S[j]

The memo keeps `H` at chunk boundaries (a cumulative sum over chunks, 1 byte per token, extended as tokens are
appended); `H` inside a chunk is computed on demand, once per chunk that needs it. Keys built on it:

- checkpoint candidates: a checkpoint at step `s` records `H` of its own tokens at the chunk boundary before `s` and
  of the rest up to `s`; the index compares them with the request's, for all live checkpoints at once
  (`StateCheckpointIndex.candidates`);
- block prefix keys: `[0, k * block_size)` -> `H(k * block_size)` mixed with `k`, the adapter and a hash of the
  multimodal identity of the prefix. Each trie node is indexed under its key, so the deepest cached block of a prompt
  is found by binary search over depths instead of a block-by-block chained walk; the miss tracker keys its memories
  by it too.

These hashes only propose: every hit is verified exactly on token ids, multimodal identity and block path (a
collision costs one failed verification). The multipliers are secret per trie, so prompts cannot be crafted to
collide. Nothing here changes state outside the request's memo and the hasher's multiplier table.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import xxhash

from ...messages import SchedulerSequence
from .node import MMIdentity, Node, NodeStateCheckpoint, root_hash

_U64 = np.uint64
_MASK = 2**64 - 1
# Token comparisons run in chunks so that no temporary exceeds ~64 KiB (large temporaries are fresh pages each
# time, and faulting them in costs more than the comparison).
_CHUNK = 1 << 16
# Hash granularity: prefix hashes are kept every `gcd(block_size, _MAX_STRIDE)` tokens.
_MAX_STRIDE = 16


def mm_identity_of(seq: SchedulerSequence, start: int, end: int) -> MMIdentity:
    """Multimodal spans overlapping `[start, end)`, relative to `start`."""
    if not seq.mm_spans:
        return ()
    return tuple((max(s.start, start) - start, min(s.end, end) - start, s.content_hash)
                 for s in seq.mm_spans if s.start < end and s.end > start)


def mm_hash(mm_identity: MMIdentity) -> int:
    """Hash of a multimodal identity; 0 for text only."""
    if not mm_identity:
        return 0
    return xxhash.xxh3_64_intdigest(np.asarray(mm_identity, dtype=np.int64).tobytes())


def draw_multipliers(rng: np.random.Generator, n: int) -> np.ndarray:
    """`n` random odd 64-bit multipliers (a test may replace this to force collisions)."""
    return rng.integers(0, 2**64, size=n, dtype=np.uint64) | _U64(1)


def equal_tokens(a: np.ndarray, b: np.ndarray) -> bool:
    """Exact equality of two token arrays."""
    if len(a) != len(b):
        return False
    return all(np.array_equal(a[i:i + _CHUNK], b[i:i + _CHUNK]) for i in range(0, len(a), _CHUNK))


def common_prefix(a: np.ndarray, b: np.ndarray, start: int = 0) -> int:
    """Number of leading tokens two token arrays share, given that they share `[0, start)`. Compared in chunks that
    double from 256 tokens: O(result - start), and no large temporaries."""
    m, i, size = min(len(a), len(b)), start, 256
    while i < m:
        j = min(m, i + size)
        same = a[i:j] == b[i:j]
        if not same.all():
            return i + int(same.argmin())
        i, size = j, min(2 * size, _CHUNK)
    return m


@dataclass(slots=True, eq=False)
class PrefixMemo:
    """What the prefix cache derived from one request's tokens: `hashes[:num_chunks + 1]` = H at chunk boundaries,
    `keys[:num_blocks + 1]` the block prefix keys; and what `BlockTrie` verified exactly against them: `nodes`, trie
    nodes holding the request's leading blocks (a detached suffix is dropped on use: nodes leave only as leaves),
    and `checkpoint`, a checkpoint whose frozen prefix equals the request's (trusted only while published). Valid
    while the request's `token_epoch` is `epoch` (its tokens were only appended to)."""
    hasher: PrefixHasher
    epoch: int
    hashes: np.ndarray
    keys: np.ndarray
    num_chunks: int = 0
    num_blocks: int = 0
    nodes: list[Node] = field(default_factory=list)
    checkpoint: NodeStateCheckpoint | None = None


class PrefixHasher:

    def __init__(self, block_size: int, seed: int | None = None):
        self.block_size = block_size
        self.stride = math.gcd(block_size, _MAX_STRIDE)
        self._rng = np.random.default_rng(seed)
        self._offset_mult = draw_multipliers(self._rng, self.stride)
        self._chunk_mult = np.zeros(0, dtype=np.uint64)
        self._mix_depth, self._mix_adapter, self._mix_mm = (int(x) for x in draw_multipliers(self._rng, 3))

    def _chunk_multipliers(self, n: int) -> np.ndarray:
        if n > len(self._chunk_mult):
            more = max(n - len(self._chunk_mult), len(self._chunk_mult), 4096)
            self._chunk_mult = np.concatenate([self._chunk_mult, draw_multipliers(self._rng, more)])
        return self._chunk_mult[:n]

    def _memo(self, seq: SchedulerSequence, num_chunks: int, num_blocks: int) -> PrefixMemo:
        memo = seq.prefix_memo
        if (not isinstance(memo, PrefixMemo) or memo.hasher is not self or memo.epoch != seq.token_epoch
                or memo.num_chunks > num_chunks):
            memo = PrefixMemo(self, seq.token_epoch, np.zeros(num_chunks + 64, _U64), np.zeros(num_blocks + 16, _U64))
            memo.keys[0] = self.root_key(seq.adapter_name)
            seq.prefix_memo = memo
        if num_chunks + 1 > len(memo.hashes):
            memo.hashes = np.concatenate([memo.hashes, np.zeros(num_chunks + 1, _U64)])
        if num_blocks + 1 > len(memo.keys):
            memo.keys = np.concatenate([memo.keys, np.zeros(num_blocks + 1, _U64)])
        return memo

    def _update(self, seq: SchedulerSequence) -> PrefixMemo:
        """The request's memo, extended by the chunks and blocks completed since the last call."""
        tokens, g = seq.token_array(), self.stride
        num_chunks, num_blocks = len(tokens) // g, len(tokens) // self.block_size
        memo = self._memo(seq, num_chunks, num_blocks)
        have = memo.num_chunks
        if num_chunks > have:
            chunks = tokens[have * g:num_chunks * g].view(np.uint64).reshape(num_chunks - have, g)
            sums = np.einsum('ij,j->i', chunks, self._offset_mult)
            sums *= self._chunk_multipliers(num_chunks)[have:]
            out = memo.hashes[have + 1:num_chunks + 1]
            np.cumsum(sums, out=out)
            out += memo.hashes[have]
            memo.num_chunks = num_chunks
        have = memo.num_blocks
        if num_blocks > have:
            depths = np.arange(have + 1, num_blocks + 1)
            memo.keys[have + 1:num_blocks + 1] = self._mix(
                memo.hashes[depths * (self.block_size // g)], depths.astype(np.uint64), seq.adapter_name,
                self._mm_hashes(seq, have + 1, num_blocks + 1))
            memo.num_blocks = num_blocks
        return memo

    def memo(self, seq: SchedulerSequence) -> PrefixMemo:
        """The request's memo, up to date with its tokens."""
        return self._update(seq)

    def chunk_hashes(self, seq: SchedulerSequence) -> np.ndarray:
        """H(c * stride) for c in [0, n // stride] (read-only)."""
        memo = self._update(seq)
        return _frozen(memo.hashes[:memo.num_chunks + 1])

    def block_keys(self, seq: SchedulerSequence) -> np.ndarray:
        """Key of every block prefix `[0, k * block_size)`, k in [0, n // block_size] (k = 0: the adapter's root)."""
        memo = self._update(seq)
        return _frozen(memo.keys[:memo.num_blocks + 1])

    def block_keys_under(self, seq: SchedulerSequence, adapter_name: str | None) -> np.ndarray:
        """`block_keys(seq)` as if the request ran under `adapter_name`: keys differ only in the adapter term."""
        delta = _U64((root_hash(adapter_name) - root_hash(seq.adapter_name)) * self._mix_adapter & _MASK)
        return self.block_keys(seq) + delta

    def prefix_hashes(self, seq: SchedulerSequence, steps: np.ndarray) -> np.ndarray:
        """H(s) for every `s` in `steps` (each <= the request's length)."""
        chunks, rems = np.divmod(np.asarray(steps, dtype=np.int64), self.stride)
        return self.chunk_hashes(seq)[chunks] + self.tail_hashes(seq, chunks, rems)

    def step_hashes(self, seq: SchedulerSequence, step: int) -> tuple[int, int]:
        """(H at the chunk boundary before `step`, the hash of the tokens from there to `step`): what a checkpoint at
        `step` records for the index."""
        chunk, rem = divmod(step, self.stride)
        tail = self.tail_hashes(seq, np.array([chunk]), np.array([rem]))
        return int(self.chunk_hashes(seq)[chunk]), int(tail[0])

    def tail_hashes(self, seq: SchedulerSequence, chunks: np.ndarray, rems: np.ndarray) -> np.ndarray:
        """H(c * stride + r) - H(c * stride) for each pair `(c, r)`, `r < stride`, `c * stride + r <=` the request's
        length: the hash of the tokens [c * stride, c * stride + r), computed once per distinct chunk `c`."""
        tokens, g = seq.token_array(), self.stride
        present = np.zeros(len(tokens) // g + 1, dtype=bool)
        present[chunks] = True
        rows = np.flatnonzero(present)
        pos = rows[:, None] * g + np.arange(g - 1)
        vals = tokens.view(np.uint64)[np.minimum(pos, len(tokens) - 1)]
        vals[pos >= len(tokens)] = 0
        # table[i, r] = V[rows[i]] * sum_{j < r} token[rows[i] * stride + j] * S[j]
        table = np.zeros((len(rows), g), dtype=np.uint64)
        np.cumsum(vals * self._offset_mult[:g - 1], axis=1, out=table[:, 1:])
        table *= self._chunk_multipliers(len(present))[rows][:, None]
        return table[(np.cumsum(present) - 1)[chunks], rems]

    def root_key(self, adapter_name: str | None) -> int:
        zero = np.zeros(1, dtype=np.uint64)
        return int(self._mix(zero, zero, adapter_name, zero)[0])

    def _mix(self, hashes: np.ndarray, depths: np.ndarray, adapter_name: str | None, mm: np.ndarray) -> np.ndarray:
        """hash + depth * A + adapter * B + mm * C (mod 2**64): a collision needs equal depth, adapter and content."""
        adapter = _U64((root_hash(adapter_name) * self._mix_adapter) & _MASK)
        return hashes + depths * _U64(self._mix_depth) + adapter + mm * _U64(self._mix_mm)

    def _mm_hashes(self, seq: SchedulerSequence, lo: int, hi: int) -> np.ndarray:
        """mm_hash of the multimodal identity of `[0, k * block_size)` for k in [lo, hi). The identity only changes at
        depths whose last block overlaps a span, so only those are computed and the rest carry the previous value."""
        if not seq.mm_spans or lo >= hi:
            return np.zeros(max(hi - lo, 0), dtype=np.uint64)
        bs, points = self.block_size, {lo}
        for span in seq.mm_spans:
            first, last = span.start // bs + 1, -(-span.end // bs)
            points.update(range(max(first, lo), min(last, hi - 1) + 1))
        points = sorted(points)
        values = np.array([mm_hash(mm_identity_of(seq, 0, k * bs)) for k in points], dtype=np.uint64)
        return values[np.searchsorted(points, np.arange(lo, hi), side='right') - 1]


def _frozen(view: np.ndarray) -> np.ndarray:
    view.flags.writeable = False
    return view
