"""Trie nodes, checkpoint records and the hashes that key them.

A `Node` is one full KV block of a cached prefix: its tokens, multimodal identity and block id; its hash chains
the parent's hash, so equal hashes imply (modulo collisions, which exact verification catches) equal prefixes.
A `NodeStateCheckpoint` is the recurrent state after exactly `step` tokens, plus, when `step` is not
block-aligned, a frozen copy of the partial KV block holding tokens `[step - step % block_size, step)`.

Each node also keeps its *continuations* sorted: the token bytes of its child blocks and of the tails of the
checkpoints anchored on it. The longest common prefix of a prompt with any of them is then found next to the
prompt's own position in that order (binary search), however many branches the node has.
"""
from __future__ import annotations

import enum
from bisect import bisect_left, insort
from dataclasses import dataclass, field

import numpy as np
import xxhash

# (start, end, content_hash) of a multimodal span, relative to the start of the hashed range.
MMIdentity = tuple[tuple[int, int, int], ...]


def root_hash(adapter_name: str | None) -> int:
    return xxhash.xxh3_64_intdigest(b'lmdeploy-root:' + (adapter_name or '').encode())


def block_hash(parent_hash: int, tokens: np.ndarray | bytes, mm_identity: MMIdentity = ()) -> int:
    """Chained hash of one full block: parent hash + token ids (an array, or its int64 bytes) + multimodal identity
    of the block's range, hashed as one byte string."""
    data = tokens if isinstance(tokens, bytes) else np.ascontiguousarray(tokens, dtype=np.int64).tobytes()
    head = parent_hash.to_bytes(8, 'little')
    if mm_identity:
        return xxhash.xxh3_64_intdigest(head + data + np.asarray(mm_identity, dtype=np.int64).tobytes())
    return xxhash.xxh3_64_intdigest(head + data)


def tail_hash(tokens: np.ndarray, mm_identity: MMIdentity = ()) -> int:
    """Hash of a checkpoint's tail: tokens from the last block start before the step up to the step."""
    h = xxhash.xxh3_64()
    h.update(np.ascontiguousarray(tokens, dtype=np.int64).tobytes())
    if mm_identity:
        h.update(np.asarray(mm_identity, dtype=np.int64).tobytes())
    return h.intdigest()


def common_token_prefix(a: bytes, b: bytes) -> int:
    """Number of leading int64 tokens two token byte strings share."""
    m = min(len(a), len(b)) // 8
    diff = np.flatnonzero(np.frombuffer(a, np.int64, m) != np.frombuffer(b, np.int64, m))
    return int(diff[0]) if diff.size else m


@dataclass(slots=True, eq=False)
class Node:
    block_id: int | None
    # Read-only int64 view of `token_bytes` (the block's tokens, stored once).
    token_ids: np.ndarray
    hash: int
    depth: int
    parent: Node | None = None
    adapter_name: str | None = None
    mm_identity: MMIdentity = ()
    children: dict[int, Node] = field(default_factory=dict)
    # (step, tail hash) -> checkpoint anchored here (steps in [depth * block_size, (depth + 1) * block_size)).
    checkpoints: dict[tuple[int, int], NodeStateCheckpoint] = field(default_factory=dict)
    last_access: int = 0
    attached: bool = True
    token_bytes: bytes = b''
    # Key of the block prefix [0, depth * block_size) (prefix_keys.py) this node is indexed under.
    prefix_key: int = 0
    # Blocks with a multimodal identity on the path root..self (lets a path be verified without visiting them all).
    num_mm_blocks: int = 0
    # Sorted token bytes of the child blocks and of the anchored checkpoints' tails (duplicates allowed).
    continuations: list[bytes] = field(default_factory=list)
    # Eviction (eviction_policy.py): matches that shared this block, and its priority as of its last use.
    num_hits: int = 0
    priority: float = 0.0
    # Routed experts of the block's tokens, uint16 [block_size, num_moe_layers, top_k] (route_store.py); None when
    # the sequence that cached it did not record them.
    routes: np.ndarray | None = None

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def add_continuation(self, token_bytes: bytes) -> None:
        if token_bytes:
            insort(self.continuations, token_bytes)

    def remove_continuation(self, token_bytes: bytes) -> None:
        if token_bytes:
            keys = self.continuations
            i = bisect_left(keys, token_bytes)
            assert i < len(keys) and keys[i] == token_bytes, 'continuation not registered'
            del keys[i]

    def longest_continuation(self, token_bytes: bytes) -> int:
        """Leading tokens of `token_bytes` shared with a child block or an anchored checkpoint tail. Comparing token
        bytes compares token sequences lexicographically (every token is 8 bytes), so the longest shared prefix is
        found next to the insertion point."""
        keys = self.continuations
        i = bisect_left(keys, token_bytes)
        best = common_token_prefix(keys[i], token_bytes) if i < len(keys) else 0
        return max(best, common_token_prefix(keys[i - 1], token_bytes)) if i else best


class CheckpointState(enum.Enum):
    RESERVED = enum.auto()   # slot (+ frozen block) held; save copies not yet queued; not matchable
    PUBLISHED = enum.auto()  # save copies queued; matchable
    RELEASED = enum.auto()   # resources returned; the record is dead


@dataclass(slots=True, eq=False)
class NodeStateCheckpoint:
    slot: int
    step: int
    frozen_block_id: int | None
    adapter_name: str | None
    # Frozen match data: token ids [0, step), multimodal identity of the tail, tail hash; the anchor node and the
    # canonical block ids of its path are fixed at publication.
    token_ids: np.ndarray
    mm_identity: MMIdentity
    tail_hash: int
    anchor: Node | None = None
    block_ids: tuple[int, ...] = ()
    state: CheckpointState = CheckpointState.RESERVED
    pin_count: int = 0
    last_access: int = 0
    # Position in the vectorised index arrays (None when not indexed).
    index_pos: int | None = None
    # Logits of the last prompt position (a prompt-end checkpoint): an identical prompt samples its first token
    # from them instead of recomputing. Opaque to paging (a host tensor).
    last_logits: object | None = None
    # Routed experts of the partial tail [step - step % block_size, step) (route_store.py); None when aligned or not
    # recorded.
    routes_tail: np.ndarray | None = None
    # Prefix hashes of `token_ids` (prefix_keys.py; the index prefilter): up to the last hash-chunk boundary before
    # `step`, and of the rest up to `step`. The multimodal identity of all of [0, step) (verified with the token ids,
    # it proves the whole prefix). The token bytes of [anchor end, step) (the anchor's continuation).
    chunk_hash: int = 0
    tail_sum: int = 0
    prefix_mm_identity: MMIdentity = ()
    tail_bytes: bytes = b''
    # The anchor's path from the root's first child (fixed at publication; attached while published).
    nodes: tuple[Node, ...] = ()
    # Eviction (eviction_policy.py): requests restored from it (plus hits inherited from an evicted deeper
    # checkpoint it is the aligned fallback of), and its priority as of its last use.
    num_hits: int = 0
    priority: float = 0.0
    # Rotary position minus token index at `step` (M-RoPE: the offset the images before it introduce); a resume
    # continues at `step + position_offset`, and a sequence whose own offset there differs is not a hit.
    position_offset: int = 0

    @property
    def published(self) -> bool:
        return self.state == CheckpointState.PUBLISHED

    @property
    def is_partial(self) -> bool:
        return self.frozen_block_id is not None
