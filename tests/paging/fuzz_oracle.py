"""What the paging state machine (test_fuzz_paging.py) models and checks: its configurations, the content oracle
and the checks of every plan, forward and match against it.

Content oracle: every KV position holds the identity of the prefix that produced it (a chained hash of adapter,
token ids and multimodal markers) and every state slot the identity of the prefix it summarises; restores, forward
writes and saves move these identities exactly as the copy plans say, so the checks compare data, not the trie's
own bookkeeping. `PagingChecks` is mixed into the machine and reads its state: `s` (Scheduler), `trie`, `cfg`
(Config), `bs`, `kv` / `state` (device contents), `ck_expect` (what each reserved checkpoint must end up holding),
`in_flight`, `external_pins`.
"""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
from hypothesis import strategies as st

from lmdeploy.pytorch.engine.cache_inputs import CacheCheckpointInputs
from lmdeploy.pytorch.messages import SchedulerSequence, SequenceStatus
from lmdeploy.pytorch.paging.block_trie.node import CheckpointState, NodeStateCheckpoint
from lmdeploy.pytorch.paging.block_trie.prefix_keys import mm_identity_of
from lmdeploy.pytorch.paging.scheduler import SchedulerOutput

ALPHABET = 6          # token ids 0..5: random prompts share prefixes often
ADAPTERS = (None, None, None, 'lora')
# A multimodal item's length follows from its content hash, as for a real image.
MM_LENGTH = {1: 1, 2: 2, 3: 3}

# Requests may need up to the whole pool (minus one block) instead of half of it; see Config.max_total_tokens.
FULL_POOL_REQUESTS = True
# Totals over every example of a run, printed at the end of each test (for docs/reliability.md).
FIGURES: Counter = Counter()


class Config:

    def __init__(self, block_size: int, num_blocks: int, hybrid: bool, max_batch_size: int, budget: int,
                 max_prefill: int, exact: bool, decode_interval_blocks: int, policies: tuple[bool, bool, bool, bool]):
        self.block_size, self.num_blocks, self.hybrid = block_size, num_blocks, hybrid
        self.max_batch_size, self.budget, self.max_prefill = max_batch_size, budget, max_prefill
        self.exact, self.decode_interval = exact, decode_interval_blocks * block_size
        # Checkpoint policies: reply checkpoints, prompt logits, branch points, eviction by value.
        self.reply, self.prompt_logits, self.branch, self.value_eviction = policies
        # Sized like memory_sizing.num_state_slots: dummy + one per running sequence + a spare + the checkpoint budget.
        self.num_state_slots = 1 + max_batch_size + 1 + budget if hybrid else 0
        self.session_len = num_blocks * block_size
        # Prompt + generated tokens of one request. Two open scheduler livelocks need a request of more than half
        # the pool (test_hit_needing_the_whole_pool_is_admitted_cold, test_request_is_not_starved_by_duplicate_
        # interior_nodes); set FULL_POOL_REQUESTS once they are fixed.
        self.max_total_tokens = (num_blocks - 1 if FULL_POOL_REQUESTS else (num_blocks - 1) // 2) * block_size

    def __repr__(self) -> str:
        return (f'Config(bs={self.block_size}, blocks={self.num_blocks}, hybrid={self.hybrid}, '
                f'batch={self.max_batch_size}, budget={self.budget}, prefill={self.max_prefill}, exact={self.exact}, '
                f'decode_interval={self.decode_interval}, reply={self.reply}, prompt_logits={self.prompt_logits}, '
                f'branch={self.branch}, value_eviction={self.value_eviction})')


configs = st.builds(
    Config, block_size=st.sampled_from([2, 3, 4]), num_blocks=st.integers(4, 16),
    hybrid=st.sampled_from([True, True, True, False]), max_batch_size=st.integers(1, 3), budget=st.integers(0, 2),
    max_prefill=st.integers(2, 24), exact=st.sampled_from([True, True, True, False]),
    decode_interval_blocks=st.sampled_from([0, 0, 1, 2]),
    policies=st.tuples(st.booleans(), st.booleans(), st.booleans(), st.booleans()))


def root_key(adapter_name: str | None) -> int:
    return hash(('root', adapter_name))


def next_key(prev: int, token: int, marker: int) -> int:
    return hash((prev, token, marker))


def marker_at(spans, pos: int) -> int:
    """Content hash of the multimodal span covering `pos` (0 for text)."""
    return next((h for s, e, h in spans if s <= pos < e), 0)


def _common_prefix(a, b) -> int:
    m = min(len(a), len(b))
    same = a[:m] == b[:m]
    return m if same.all() else int(same.argmin())


class PagingChecks:
    """The machine's content model and its checks (mixed into `PagingMachine`; see the module docstring)."""

    # ---- keys ------------------------------------------------------------------------------------------------------
    def keys(self, seq: SchedulerSequence, upto: int) -> list[int]:
        """keys[i] = identity of the prefix [0, i) (keys[0] = the adapter's root)."""
        keys = self._keys.setdefault(seq.seq_id, [root_key(seq.adapter_name)])
        spans = [(sp.start, sp.end, sp.content_hash) for sp in seq.mm_spans]
        for i in range(len(keys) - 1, upto):
            keys.append(next_key(keys[i], seq.token_ids[i], marker_at(spans, i)))
        return keys

    def node_keys(self, node) -> list[int]:
        """Identities of a trie node's positions, from its own tokens and multimodal identity only."""
        if node in self._node_keys:
            return self._node_keys[node]
        prev = root_key(node.adapter_name) if node.parent.is_root else self.node_keys(node.parent)[-1]
        out = []
        for j, token in enumerate(node.token_ids.tolist()):
            prev = next_key(prev, token, marker_at(node.mm_identity, j))
            out.append(prev)
        self._node_keys[node] = out
        return out

    # ---- checks -----------------------------------------------------------------------------------------------
    def _check_plans(self, out: SchedulerOutput) -> None:
        """Invariant 6 (validated offsets, unique destinations disjoint from sources), 1 and 9."""
        bm, trie = self.s.block_manager, self.trie
        CacheCheckpointInputs.build(out.kv_restores, out.state_restores, out.kv_saves, out.state_saves,
                                    bm.resolve_gpu_block_offsets)
        assert len(out.seqs) <= self.cfg.max_batch_size
        # The prefill budget holds, except where a piece is one whole image longer than the budget left (a chunk
        # never splits an image: it stops before one, or, starting at one, takes it whole).
        whole_image = any(n > 1 and any(sp.start == seq.num_computed and sp.end == seq.num_computed + n
                                        for sp in seq.mm_spans) for seq, n in zip(out.seqs, out.num_new_tokens))
        assert whole_image or sum(n for n in out.num_new_tokens if n > 1) <= self.cfg.max_prefill
        for seq, n in zip(out.seqs, out.num_new_tokens):
            assert seq.is_prefix_cache_boundary_safe(seq.num_computed + n), 'a chunk ends inside an image'
        node_blocks = set(trie.kv.owners())
        frozen = {ck.frozen_block_id for ck in trie.checkpoints.live()} if trie.checkpoints is not None else set()
        for seq, n in zip(out.seqs, out.num_new_tokens):
            assert seq.status == SequenceStatus.RUNNING and 1 <= n <= seq.num_remaining
            need = math.ceil((seq.num_computed + n) / self.bs)
            assert len(seq.block_ids) >= need
            written = {seq.block_ids[p // self.bs] for p in range(seq.num_computed, seq.num_computed + n)}
            assert not written & node_blocks, f'a forward writes trie-owned blocks {written & node_blocks}'
            assert not written & frozen, f'a forward writes frozen checkpoint blocks {written & frozen}'
            assert all(bm.ref_count(b) == 1 for b in written), 'a forward writes a shared block'
        slots = {seq.state_slot: seq for seq in out.seqs + [seq for seq, _ in out.logits_hits]}
        for ck in out.pinned:
            assert ck.published and ck.pin_count >= 1
        for src, dst in out.kv_restores:
            assert bm.ref_count(dst) == 1 and dst not in node_blocks and src in frozen
        for src, dst in out.state_restores:
            assert dst in slots and any(ck.slot == src for ck in out.pinned)
        for seq, logits in out.logits_hits:
            # An identical prompt: no tokens to feed, the first token comes from the kept prompt-end logits.
            assert self.cfg.prompt_logits and seq.status == SequenceStatus.RUNNING and seq not in out.seqs
            assert seq.num_computed == seq.num_tokens
            assert seq.num_preemptions or seq.num_cached == seq.num_tokens  # num_cached: the first admission's
            assert logits == ('logits', self.keys(seq, seq.num_tokens)[seq.num_tokens]), 'logits of another prompt'
            FIGURES['logits_hits'] += 1
        self._check_saves(out)
        FIGURES['restores'] += len(out.state_restores) + len(out.kv_restores)
        FIGURES['admitted_with_hit'] += len(out.pinned)

    def _check_saves(self, out: SchedulerOutput) -> None:
        """Reserved checkpoints: safe boundary, mode, their save copies; remember what they must end up holding."""
        cuts = {(cut.seq.seq_id, cut.step, cut.slot) for cut in getattr(out, 'state_cuts', ())}
        for seq, ck in out.reserved:
            assert ck.state == CheckpointState.RESERVED and ck.pin_count == 0
            assert seq.is_prefix_cache_boundary_safe(ck.step), 'a checkpoint inside a multimodal span'
            assert self.cfg.exact or ck.step % self.bs == 0
            if (seq.seq_id, ck.step, ck.slot) in cuts:
                # A state cut inside this forward's piece (aligned fallback of a branch point): no save copy.
                assert not ck.is_partial and seq.num_computed < ck.step
                assert all(dst != ck.slot for _, dst in out.state_saves)
            else:
                assert (seq.state_slot, ck.slot) in out.state_saves
            if ck.is_partial:
                assert (seq.block_ids[ck.step // self.bs], ck.frozen_block_id) in out.kv_saves
            keys = self.keys(seq, ck.step)
            rem = ck.step % self.bs
            self.ck_expect[ck] = (keys[ck.step], keys[ck.step - rem + 1:ck.step + 1])
            FIGURES['checkpoints_reserved'] += 1

    def _check_computed(self, seq: SchedulerSequence) -> None:
        """KV of [0, num_computed) and the state after num_computed tokens are exactly the sequence's."""
        keys = self.keys(seq, seq.num_computed)
        for p in range(seq.num_computed):
            got = self.kv[seq.block_ids[p // self.bs]][p % self.bs]
            assert got == keys[p + 1], f'seq {seq.seq_id}: KV at position {p} is not its own'

    def _simulate_forward(self, out: SchedulerOutput) -> None:
        """restore copies -> forward -> save copies, on the content model (engine order, invariant 5)."""
        for src, dst in out.kv_restores:
            self.kv[dst] = list(self.kv[src])
        for src, dst in out.state_restores:
            self.state[dst] = self.state[src]
        for seq, n in zip(out.seqs, out.num_new_tokens):
            start = seq.num_computed
            self._check_computed(seq)
            keys = self.keys(seq, start + n)
            if self.cfg.hybrid:
                if start:
                    assert self.state[seq.state_slot] == keys[start], f'seq {seq.seq_id}: wrong state at {start}'
                self.state[seq.state_slot] = keys[start + n]
            for p in range(start, start + n):
                self.kv[seq.block_ids[p // self.bs]][p % self.bs] = keys[p + 1]
        for cut in out.state_cuts:  # the forward leaves the state at each cut in its row
            assert cut.seq.num_computed < cut.step < cut.seq.num_computed + out.num_new_tokens[out.seqs.index(cut.seq)]
            self.state[cut.slot] = self.keys(cut.seq, cut.step)[cut.step]
        for seq, _ in out.logits_hits:
            self._check_computed(seq)
            assert self.state[seq.state_slot] == self.keys(seq, seq.num_tokens)[seq.num_tokens]
        self._simulate_saves(out)

    def _simulate_saves(self, out: SchedulerOutput) -> None:
        for src, dst in out.kv_saves:
            self.kv[dst] = list(self.kv[src])
        for src, dst in out.state_saves:
            self.state[dst] = self.state[src]

    def _valid_for(self, ck: NodeStateCheckpoint, query: SchedulerSequence, keys: list[int]) -> bool:
        """Oracle: may `query` resume from `ck`? (Same prefix identity, a safe boundary, one token left.)"""
        usable = ck.step <= query.num_tokens - 1 or (ck.step == query.num_tokens and ck.last_logits is not None)
        return (ck.adapter_name == query.adapter_name and usable and query.is_prefix_cache_boundary_safe(ck.step)
                and self.ck_expect[ck][0] == keys[ck.step])

    def _check_match(self, query: SchedulerSequence) -> None:
        m = self.trie.match(query, peers=self.s.running)
        self._check_match_against_walks(query, m)
        keys = self.keys(query, query.num_tokens)
        n = query.num_tokens
        if m.num_tokens == n:
            assert m.checkpoint is not None and m.checkpoint.last_logits is not None, 'a whole prompt without logits'
            FIGURES['match_logits_hits'] += 1
        else:
            assert 0 <= m.num_tokens <= n - 1, 'a match must leave one token to compute'
        assert query.is_prefix_cache_boundary_safe(m.num_tokens)
        if m.junction:
            assert self.cfg.branch and m.num_tokens < m.junction < n and query.is_prefix_cache_boundary_safe(m.junction)
        if m.miss is not None:
            assert sum(m.miss.values()) == n - m.num_tokens, f'miss reasons {dict(m.miss)} do not cover the misses'
        assert len(m.nodes) == m.num_tokens // self.bs
        for depth, node in enumerate(m.nodes):
            assert node.attached and node.depth == depth + 1
            assert self.node_keys(node) == keys[depth * self.bs + 1:(depth + 1) * self.bs + 1], 'wrong shared block'
        if not self.cfg.hybrid:
            assert m.checkpoint is None and m.num_tokens % self.bs == 0
            return
        live = [ck for ck in self.trie.checkpoints.live() if ck.published]
        deepest = max((ck.step for ck in live if self._valid_for(ck, query, keys)), default=0)
        if m.checkpoint is None:
            assert m.num_tokens == 0 and deepest == 0, f'missed a valid checkpoint at {deepest}'
            return
        ck = m.checkpoint
        FIGURES['match_hits'] += 1
        assert ck.published and self.trie.checkpoints.verify(ck) and ck.step == m.num_tokens
        assert self._valid_for(ck, query, keys), 'matched a checkpoint of a different prefix'
        assert ck.step == deepest, f'matched {ck.step}, the deepest valid checkpoint is {deepest}'
        assert ck.block_ids == tuple(n.block_id for n in m.nodes)

    def _check_match_against_walks(self, query: SchedulerSequence, m) -> None:
        """The vectorised search (block prefix keys, checkpoint paths, sorted continuations, peer prefix hashes)
        finds exactly what the plain block-by-block walk and brute-force comparisons find."""
        trie, bs, n = self.trie, self.bs, query.num_tokens
        tokens = np.asarray(query.token_ids, dtype=np.int64)
        node, path = trie.kv.root(query.adapter_name), []
        for i in range(n // bs):
            node = trie.kv.find_child(node, tokens[i * bs:(i + 1) * bs], mm_identity_of(query, i * bs, (i + 1) * bs))
            if node is None:
                break
            path.append(node)
        assert trie._cached_path(query, query.token_array(), []) == path, 'a memoized run differs from the walk'
        query.prefix_memo = None
        assert trie._cached_path(query, query.token_array(), []) == path, 'the key search missed the cached run'
        assert list(m.nodes) == path[:m.num_tokens // bs]
        if not self.cfg.hybrid:
            depth = min(len(path), (n - 1) // bs)
            while depth and not query.is_prefix_cache_boundary_safe(depth * bs):
                depth -= 1
            assert m.num_tokens == depth * bs, 'a dense match shorter than the cached run'
            return
        if not self.cfg.branch:
            return
        parent, base = (path[-1] if path else trie.kv.root(query.adapter_name)), len(path) * bs
        tails = [c.token_ids for c in parent.children.values()]
        tails += [ck.token_ids[base:] for ck in parent.checkpoints.values()]
        covered = base + max((_common_prefix(tokens[base:base + bs], t) for t in tails), default=0)
        lcps = []   # peers: the common prefix serving the most tokens (length x peers reaching it), deeper on a tie
        for peer in self.s.running:
            if peer is not query and peer.adapter_name == query.adapter_name:
                common = _common_prefix(tokens, np.asarray(peer.token_ids, dtype=np.int64))
                whole = common == n and (self.cfg.prompt_logits or peer.num_tokens > common)
                if common >= min(bs, n) and common > m.num_tokens and not whole:
                    lcps.append(common)
        lcps.sort(reverse=True)
        covered = max(covered, max(((c * (i + 1), c) for i, c in enumerate(lcps)), default=(0, 0))[1])
        junction = min(covered, n - 1)
        if not self.cfg.exact:
            junction -= junction % bs
        while junction > m.num_tokens and not query.is_prefix_cache_boundary_safe(junction):
            junction -= 1
        assert m.junction == (junction if junction > m.num_tokens else 0), 'a branch point off the brute force one'

    def _check_all(self) -> None:
        s, trie, bm, sm = self.s, self.trie, self.s.block_manager, self.s.state_manager
        s.check_integrity()
        block_owners, slot_owners = Counter(), Counter()
        for seq in s.running + s.waiting:
            block_owners.update(seq.block_ids)
            if seq.state_slot is not None:
                slot_owners[seq.state_slot] += 1
        trie_blocks, ck_slots = trie.owners()
        block_owners.update(trie_blocks)
        slot_owners.update(ck_slots)
        assert bm.num_free + len(block_owners) == bm.num_blocks, 'a KV block is lost'
        if sm is not None:
            assert sm.num_free + len(slot_owners) == sm.num_usable, 'a state slot is lost'
            assert max(slot_owners.values(), default=1) == 1, 'a state slot is owned twice'
        for seq in s.waiting:
            assert seq.status == SequenceStatus.WAITING and not seq.block_ids and seq.state_slot is None
        for seq in s.running:
            assert seq.status == SequenceStatus.RUNNING
            assert len(seq.block_ids) >= math.ceil(seq.num_computed / self.bs)
            assert (seq.state_slot is not None) == self.cfg.hybrid
            self._check_computed(seq)
            if self.cfg.hybrid and seq.num_computed and self.in_flight is None:
                assert self.state[seq.state_slot] == self.keys(seq, seq.num_computed)[seq.num_computed]
        self._check_trie()

    def _check_trie(self) -> None:
        trie = self.trie
        reachable, stack = set(), list(trie.kv.roots.values())
        while stack:
            node = stack.pop()
            assert node.attached
            for child in node.children.values():
                assert child.parent is node and child.depth == node.depth + 1
                assert self.kv[child.block_id] == self.node_keys(child), 'a trie block holds foreign KV'
                reachable.add(child)
                stack.append(child)
        assert len(reachable) == trie.kv.num_nodes, 'nodes attached under an evicted parent'
        if trie.checkpoints is None:
            return
        in_flight = self.in_flight.pinned if self.in_flight is not None else []
        for ck in self.external_pins:
            assert ck.published and ck.pin_count >= 1
        for ck in trie.checkpoints.live():
            if not ck.published:
                # Only the in-flight forward's reservations are unpublished.
                assert self.in_flight is not None and any(ck is r for _, r in self.in_flight.reserved)
                continue
            assert trie.checkpoints.verify(ck), 'a published checkpoint no longer verifies'
            assert ck.anchor.is_root or ck.anchor in reachable
            assert ck.anchor.checkpoints.get((ck.step, ck.tail_hash)) is ck
            assert ck.pin_count == sum(p is ck for p in self.external_pins) + sum(p is ck for p in in_flight)
            state_key, tail = self.ck_expect[ck]
            assert self.state[ck.slot] == state_key, f'checkpoint at {ck.step} holds the wrong state'
            if ck.is_partial:
                assert self.kv[ck.frozen_block_id][:len(tail)] == tail, f'frozen block of {ck.step} is wrong'
