"""KV block lifecycle inside the trie: attach full blocks as nodes, find them by chained hash, drop leaves.

Owns: one reference on the block of every attached node. Topology only grows by new leaves or shrinks by
removing leaves. A leaf can be evicted when nothing else references its block (ref count 1 = the trie's own) and
none of its checkpoints is pinned or reserved; its unpinned checkpoints go with it. Hence every ancestor of an
attached node is attached. Leaves wait in a heap by `ReusePolicy` priority (eviction_policy.py): a dense model's
leaf by its own hits, a hybrid model's by its most valuable checkpoint (none left: it can serve no hit and goes
first).

Two ways to find a node: `find_child` (chained hash of one block under a known parent, exact token check), and
`lookup` by the key of its whole block prefix (prefix_keys.py), which only proposes a node: the caller verifies
its path.
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from ..block_manager import BlockManager
from .eviction_policy import DEAD, LazyMinHeap, ReusePolicy
from .node import MMIdentity, Node, block_hash, root_hash
from .prefix_keys import PrefixHasher


class TrieKVLifecycle:

    def __init__(self, block_manager: BlockManager, block_size: int, hasher: PrefixHasher,
                 policy: ReusePolicy | None = None, kv_block_bytes: int = 1, hybrid: bool = False):
        self.block_manager = block_manager
        self.block_size = block_size
        self.hasher = hasher
        self.policy = policy or ReusePolicy(lru=True)
        self.kv_block_bytes = max(kv_block_bytes, 1)
        # Hybrid models: a block serves hits only through the checkpoints on or below it.
        self.hybrid = hybrid
        self._leaf_heap: LazyMinHeap[Node] = LazyMinHeap()
        self.roots: dict[str | None, Node] = {}
        # Prefix key -> a node indexed under it (the first one on a collision).
        self._by_key: dict[int, Node] = {}
        # Every attached node. Ownership is counted from this set, not from `_by_key`: two nodes may share a
        # key (a collision) and each still holds its own block reference.
        self._nodes: set[Node] = set()
        self._leaves: set[Node] = set()
        self.num_nodes = 0
        self.num_evicted = 0

    def root(self, adapter_name: str | None) -> Node:
        node = self.roots.get(adapter_name)
        if node is None:
            node = Node(block_id=None, token_ids=np.zeros(0, dtype=np.int64), hash=root_hash(adapter_name), depth=0,
                        adapter_name=adapter_name, prefix_key=self.hasher.root_key(adapter_name))
            self.roots[adapter_name] = node
        return node

    def find_child(self, parent: Node, tokens: np.ndarray, mm_identity: MMIdentity) -> Node | None:
        """The attached child of `parent` holding exactly `tokens` (hash lookup, then exact verification)."""
        child = parent.children.get(block_hash(parent.hash, tokens, mm_identity))
        if child is None or child.mm_identity != mm_identity or not np.array_equal(child.token_ids, tokens):
            return None
        return child

    def lookup(self, prefix_key: int) -> Node | None:
        """A node indexed under `prefix_key`: a proposal only (keys may collide); verify its path."""
        return self._by_key.get(prefix_key)

    def attach(self, parent: Node, block_id: int, tokens: np.ndarray, mm_identity: MMIdentity, prefix_key: int,
               now: int) -> Node | None:
        """Attach a full block as a child of `parent` (the trie takes one ref); None on a hash collision.
        `prefix_key` is the key of the block prefix the new node ends. The new node is not queued as an evictable
        leaf: the caller attaches a child under it next, or calls `settle_leaf` on it (a path of many new blocks
        queues only its last one)."""
        token_bytes = np.ascontiguousarray(tokens, dtype=np.int64).tobytes()
        h = block_hash(parent.hash, token_bytes, mm_identity)
        existing = parent.children.get(h)
        if existing is not None:
            same = existing.mm_identity == mm_identity and existing.token_bytes == token_bytes
            return existing if same else None
        node = Node(block_id=block_id, token_ids=np.frombuffer(token_bytes, dtype=np.int64), hash=h,
                    depth=parent.depth + 1, parent=parent, adapter_name=parent.adapter_name,
                    mm_identity=mm_identity, last_access=now, token_bytes=token_bytes, prefix_key=prefix_key,
                    num_mm_blocks=parent.num_mm_blocks + bool(mm_identity))
        self.block_manager.add_ref([block_id])
        parent.children[h] = node
        parent.add_continuation(token_bytes)
        self._by_key.setdefault(prefix_key, node)
        self._nodes.add(node)
        if parent in self._leaves:
            self._leaves.discard(parent)
            self._leaf_heap.discard(parent)
        node.priority = self.policy.priority(0, self.block_size, self.kv_block_bytes, now)
        self.num_nodes += 1
        return node

    def settle_leaf(self, node: Node) -> None:
        """Queue `node` as an evictable leaf if it is one and is not yet (the last node `attach` added)."""
        if node.attached and not node.is_root and node.is_leaf and node not in self._leaves:
            self._leaves.add(node)
            self.refresh(node)

    def touch_path(self, nodes: list[Node], now: int) -> None:
        """A request was admitted sharing `nodes`: one more use of each."""
        self.policy.touch(nodes, self.block_size, self.kv_block_bytes, now)
        if nodes:
            self.refresh(nodes[-1])

    def leaf_priority(self, node: Node) -> float:
        if not self.hybrid:
            return node.priority
        best = max((ck.priority for ck in node.checkpoints.values() if ck.published), default=DEAD)
        return max(best, node.priority) if self.policy.lru else best

    def refresh(self, node: Node) -> None:
        """Re-queue an attached leaf at its current priority (after its block or checkpoints changed)."""
        if node in self._leaves:
            self._leaf_heap.push(node, self.leaf_priority(node))

    def peek_leaf(self, eligible) -> tuple[float, Node] | None:
        """The lowest-priority leaf that `eligible` accepts (its block only the trie's, its checkpoints all
        evictable), left in place; None when there is none."""
        return self._leaf_heap.peek(eligible)

    def detach(self, node: Node) -> None:
        """Remove a leaf and drop the trie's reference on its block."""
        assert node.is_leaf and not node.is_root and not node.checkpoints
        parent = node.parent
        del parent.children[node.hash]
        parent.remove_continuation(node.token_bytes)
        if self._by_key.get(node.prefix_key) is node:
            del self._by_key[node.prefix_key]
        self._nodes.discard(node)
        self._leaves.discard(node)
        self._leaf_heap.discard(node)
        if not parent.is_root and parent.is_leaf:
            self._leaves.add(parent)
            self.refresh(parent)
        node.attached = False
        self.block_manager.free([node.block_id])
        self.num_nodes -= 1
        self.num_evicted += 1

    def owners(self) -> Counter:
        blocks: Counter = Counter()
        for node in self._nodes:
            blocks[node.block_id] += 1
        return blocks
