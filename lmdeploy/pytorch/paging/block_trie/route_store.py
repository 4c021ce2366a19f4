"""Routed experts in the prefix cache: what a hit replays instead of the forward it skips.

A cache hit skips the forward over the cached prefix, so the routes of those positions (the experts each MoE layer
chose for each token, `SchedulerSequence.routed_experts`) must come from the cache. They are kept with what the
cache already owns, so they live and die with it:

- a trie `Node` keeps the rows of its block's `block_size` tokens (`Node.routes`), taken when the block attaches;
- a checkpoint at a step that is not block-aligned keeps the rows of its partial tail `[step - step % block_size,
  step)` (`NodeStateCheckpoint.routes_tail`), taken when it is published (its frozen block holds the same tokens'
  KV). An aligned checkpoint needs none: its prefix is exactly its path's blocks.

A hit at step `s` (path nodes `[0, s // block_size)` plus, when `s` is not aligned, the checkpoint) replays the
concatenation of those rows as the sequence's rows `[0, s)`. Only sequences that record routes (engine flag on)
store or replay anything; with the flag off nodes and checkpoints hold None and cost nothing.

A recording sequence can only take a hit whose rows all exist (`has_routes`); the matcher otherwise falls back to
the deepest point it can prove (a shallower checkpoint, or fewer blocks) and counts the tokens in between under the
miss reason `routes_missing`. Routes share their block's or checkpoint's lifetime, so today this happens only for
blocks that were cached without routes. What the cache holds is counted where routes are kept and where their owner
is evicted (`BlockTrie.routes_bytes`, O(1); `check_integrity` compares it with a walk). Speculative drafts never
reach the cache (drafts are not checkpoints), so their routes are never stored or returned; when MTP lands, draft
forwards must not write the sequence's rows.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ...messages import SchedulerSequence
from .node import Node, NodeStateCheckpoint


def keep_block_routes(node: Node, seq: SchedulerSequence, index: int, block_size: int) -> int:
    """At attach: block `index` of `seq` is (or was deduplicated onto) `node`; keep its rows if the node lacks them.
    Returns the bytes this adds to the cache."""
    rows = seq.routed_experts
    end = (index + 1) * block_size
    if rows is None or node.routes is not None or len(rows) < end:
        return 0
    node.routes = rows.rows(end - block_size, end)
    return node.routes.nbytes


def keep_checkpoint_routes(ck: NodeStateCheckpoint, seq: SchedulerSequence, block_size: int) -> int:
    """At publication: the rows of the checkpoint's partial tail (none for an aligned step). Returns the bytes this
    adds to the cache."""
    rows = seq.routed_experts
    rem = ck.step % block_size
    if rows is None or not rem or len(rows) < ck.step:
        return 0
    ck.routes_tail = rows.rows(ck.step - rem, ck.step)
    return ck.routes_tail.nbytes


def block_bytes(node: Node) -> int:
    """Bytes of the routes `node` keeps (what its eviction frees)."""
    return node.routes.nbytes if node.routes is not None else 0


def tail_bytes(ck: NodeStateCheckpoint) -> int:
    """Bytes of the routes `ck` keeps (what its eviction frees)."""
    return ck.routes_tail.nbytes if ck.routes_tail is not None else 0


def drop_block_routes(node: Node) -> int:
    """Forget a block's routes (a recording request then cannot take a hit through it); returns the bytes freed."""
    freed, node.routes = block_bytes(node), None
    return freed


def has_routes(nodes: Iterable[Node], ck: NodeStateCheckpoint | None, step: int, block_size: int) -> bool:
    """Whether the rows of `[0, step)` can be replayed from `nodes` (the path, at least `step // block_size` long)
    and, for an unaligned step, `ck`."""
    depth = step // block_size
    if any(node.routes is None for node, _ in zip(nodes, range(depth))):
        return False
    return step % block_size == 0 or (ck is not None and ck.routes_tail is not None)


def routed_depth(nodes: list[Node], depth: int) -> int:
    """The number of leading nodes (at most `depth`) that all keep their routes."""
    return next((i for i, node in enumerate(nodes[:depth]) if node.routes is None), min(depth, len(nodes)))


def replay(seq: SchedulerSequence, nodes: list[Node], ck: NodeStateCheckpoint | None, step: int,
           block_size: int) -> None:
    """At admission: the sequence's rows `[0, step)` from the hit (a no-op for a sequence that does not record)."""
    rows = seq.routed_experts
    if rows is None or step == 0:
        return
    parts = [node.routes for node in nodes[:step // block_size]]
    if step % block_size:
        parts.append(ck.routes_tail)
    rows.write(0, np.concatenate(parts))


def bytes_held(roots: Iterable[Node], checkpoints: Iterable[NodeStateCheckpoint]) -> int:
    """Host bytes of the routes the cache keeps, by a walk of the trie (the integrity check's reference for the
    running count `BlockTrie.routes_bytes`; not for a hot path)."""
    total, stack = 0, list(roots)
    while stack:
        node = stack.pop()
        total += block_bytes(node)
        stack.extend(node.children.values())
    return total + sum(tail_bytes(ck) for ck in checkpoints)
