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
the deepest point it can prove (a shallower checkpoint, or fewer blocks) and counts the tokens in between under
the miss reason `routes_missing`. Routes share their block's or checkpoint's lifetime, so today this happens only
for blocks that were cached without routes. Speculative drafts never reach the cache (drafts are not checkpoints),
so their routes are never stored or returned; when MTP lands, draft forwards must not write the sequence's rows.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ...messages import SchedulerSequence
from .node import Node, NodeStateCheckpoint


def keep_block_routes(node: Node, seq: SchedulerSequence, index: int, block_size: int) -> None:
    """At attach: block `index` of `seq` is (or was deduplicated onto) `node`; keep its rows if the node lacks them."""
    rows = seq.routed_experts
    end = (index + 1) * block_size
    if rows is not None and node.routes is None and len(rows) >= end:
        node.routes = rows.rows(end - block_size, end)


def keep_checkpoint_routes(ck: NodeStateCheckpoint, seq: SchedulerSequence, block_size: int) -> None:
    """At publication: the rows of the checkpoint's partial tail (none for an aligned step)."""
    rows = seq.routed_experts
    rem = ck.step % block_size
    if rows is not None and rem and len(rows) >= ck.step:
        ck.routes_tail = rows.rows(ck.step - rem, ck.step)


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
    """Host bytes of the routes the cache keeps (walks the trie: for statistics, not for a hot path)."""
    total, stack = 0, list(roots)
    while stack:
        node = stack.pop()
        total += node.routes.nbytes if node.routes is not None else 0
        stack.extend(node.children.values())
    return total + sum(ck.routes_tail.nbytes for ck in checkpoints if ck.routes_tail is not None)
