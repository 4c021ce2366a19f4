"""Trie nodes, checkpoint records and the hashes that key them.

A `Node` is one full KV block of a cached prefix: its tokens, multimodal identity and block id; its hash chains
the parent's hash, so equal hashes imply (modulo collisions, which exact verification catches) equal prefixes.
A `NodeStateCheckpoint` is the recurrent state after exactly `step` tokens, plus, when `step` is not
block-aligned, a frozen copy of the partial KV block holding tokens `[step - step % block_size, step)`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np
import xxhash

# (start, end, content_hash) of a multimodal span, relative to the start of the hashed range.
MMIdentity = tuple[tuple[int, int, int], ...]


def root_hash(adapter_name: str | None) -> int:
    return xxhash.xxh3_64_intdigest(b'lmdeploy-root:' + (adapter_name or '').encode())


def block_hash(parent_hash: int, tokens: np.ndarray, mm_identity: MMIdentity = ()) -> int:
    """Chained hash of one full block: parent hash + token ids + multimodal identity of the block's range."""
    h = xxhash.xxh3_64()
    h.update(parent_hash.to_bytes(8, 'little'))
    h.update(np.ascontiguousarray(tokens, dtype=np.int64).tobytes())
    if mm_identity:
        h.update(np.asarray(mm_identity, dtype=np.int64).tobytes())
    return h.intdigest()


def tail_hash(tokens: np.ndarray, mm_identity: MMIdentity = ()) -> int:
    """Hash of a checkpoint's tail: tokens from the last block start before the step up to the step."""
    h = xxhash.xxh3_64()
    h.update(np.ascontiguousarray(tokens, dtype=np.int64).tobytes())
    if mm_identity:
        h.update(np.asarray(mm_identity, dtype=np.int64).tobytes())
    return h.intdigest()


@dataclass(slots=True, eq=False)
class Node:
    block_id: int | None
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

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def is_leaf(self) -> bool:
        return not self.children


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

    @property
    def published(self) -> bool:
        return self.state == CheckpointState.PUBLISHED

    @property
    def is_partial(self) -> bool:
        return self.frozen_block_id is not None
