"""BlockManager and Scheduler on the CPU, without a model.

A step makes the engine's scheduler calls: `schedule()` -> (a sampled token for every sequence that fed its last
token) -> `update()` -> `commit()` -> `release()`. `check_integrity()` runs after every step.
"""
from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from lmdeploy.pytorch.config import CacheConfig, SchedulerConfig
from lmdeploy.pytorch.messages import SamplingParams, SchedulerSequence, SequenceStatus
from lmdeploy.pytorch.paging import block_manager
from lmdeploy.pytorch.paging.block_manager import BlockManager
from lmdeploy.pytorch.paging.scheduler import Scheduler
from lmdeploy.pytorch.paging.scheduler_output import SampledToken

SAMPLED_TOKEN = 7


def _free_list(block_manager: BlockManager) -> list[int]:
    """Free blocks in the order they will be handed out."""
    return list(block_manager._free)


def _scheduler(num_blocks: int = 8, block_size: int = 4, max_prefill_token_num: int = 16, max_batch_size: int = 8,
               num_state_slots: int = 0) -> Scheduler:
    cache = CacheConfig(block_size=block_size, kernel_block_size=block_size, num_blocks=num_blocks,
                        num_state_slots=num_state_slots)
    config = SchedulerConfig(max_batch_size=max_batch_size, max_prefill_token_num=max_prefill_token_num,
                             session_len=num_blocks * block_size)
    return Scheduler(config, cache, needs_state=num_state_slots > 0)


def _seq(seq_id: int, num_prompt_tokens: int, max_new_tokens: int = 4) -> SchedulerSequence:
    return SchedulerSequence(seq_id=seq_id, token_ids=list(range(100, 100 + num_prompt_tokens)),
                             num_prompt_tokens=num_prompt_tokens,
                             sampling=SamplingParams(max_new_tokens=max_new_tokens))


def _step(scheduler: Scheduler) -> list[tuple[int, int]]:
    """One engine step by hand; returns the scheduled (seq_id, num_new_tokens) pairs."""
    out = scheduler.schedule()
    scheduler.check_integrity()
    sampled = [SampledToken(seq, SAMPLED_TOKEN, None) for seq, n in zip(out.seqs, out.num_new_tokens)
               if seq.num_computed + n == seq.num_tokens]  # fed its last token: a token is sampled
    scheduler.release(scheduler.commit(out, scheduler.update(out, sampled)))
    scheduler.check_integrity()
    return [(seq.seq_id, n) for seq, n in zip(out.seqs, out.num_new_tokens)]


# ---- SchedulerSequence ------------------------------------------------------------------------------------------
def test_token_array_follows_appends_and_rebuilds():
    seq = SchedulerSequence(seq_id=1, token_ids=[1, 2, 3], num_prompt_tokens=3, sampling=SamplingParams())
    first = seq.token_array()
    assert first.tolist() == [1, 2, 3] and first.dtype == np.int64 and not first.flags.writeable
    epoch = seq.token_epoch
    for t in range(200):                         # decode appends, past the initial capacity
        seq.token_ids.append(t)
        assert seq.token_array()[-1] == t
    assert seq.token_array().tolist() == seq.token_ids and seq.token_epoch == epoch   # extended, never rebuilt
    assert first.tolist() == [1, 2, 3]           # an array handed out earlier never changes
    seq.token_ids[-1] = 7                        # the last token rewritten: rebuilt
    assert seq.token_array().tolist() == seq.token_ids and seq.token_epoch == epoch + 1
    seq.token_ids.pop()                          # shorter: rebuilt
    assert seq.token_array().tolist() == seq.token_ids and seq.token_epoch == epoch + 2
    seq.token_ids = [9, 8]                       # another list: rebuilt
    assert seq.token_array().tolist() == [9, 8] and seq.token_epoch == epoch + 3


def test_adopted_token_array_is_the_buffer_and_extends_like_a_built_one():
    # the engine hands the prompt check's int64 array over (`adopt_token_array`): no second conversion
    ids = [5, 6, 7]
    seq = SchedulerSequence(seq_id=1, token_ids=list(ids), num_prompt_tokens=3, sampling=SamplingParams())
    adopted = np.array(ids, dtype=np.int64)
    seq.adopt_token_array(adopted)
    epoch = seq.token_epoch
    first = seq.token_array()
    assert np.shares_memory(first, adopted)
    assert first.tolist() == ids and not first.flags.writeable and seq.token_epoch == epoch
    for t in range(100):                         # appends grow past the adopted buffer, never rebuilding
        seq.token_ids.append(t)
        assert seq.token_array()[-1] == t
    assert seq.token_array().tolist() == seq.token_ids and seq.token_epoch == epoch
    assert first.tolist() == ids
    seq.token_ids[-1] = 1                        # a rewritten token still rebuilds
    assert seq.token_array().tolist() == seq.token_ids and seq.token_epoch == epoch + 1



# ---- BlockManager ----------------------------------------------------------------------------------------------
def test_allocate_hands_out_lowest_free_ids_in_order():
    bm = BlockManager(8)
    assert bm.allocate(3) == [0, 1, 2]
    assert bm.allocate(2) == [3, 4]
    assert _free_list(bm) == [5, 6, 7]
    assert bm.num_free == 3
    assert [bm.ref_count(b) for b in range(8)] == [1, 1, 1, 1, 1, 0, 0, 0]


def test_freed_blocks_go_to_the_back_of_the_free_list():
    bm = BlockManager(6)
    bm.allocate(4)  # [0, 1, 2, 3] used, free [4, 5]
    bm.free([2, 0])
    assert _free_list(bm) == [4, 5, 2, 0]
    assert bm.allocate(3) == [4, 5, 2]
    assert _free_list(bm) == [0]


def test_allocating_more_than_free_raises_and_allocates_nothing():
    bm = BlockManager(4)
    bm.allocate(3)
    assert not bm.can_allocate(2)
    with pytest.raises(MemoryError, match='need 2 KV blocks, 1 free'):
        bm.allocate(2)
    assert _free_list(bm) == [3]
    assert bm.can_allocate(1) and bm.can_allocate(0)


def test_shared_block_returns_to_free_list_only_after_its_last_reference():
    bm = BlockManager(4)
    blocks = bm.allocate(2)  # [0, 1]
    bm.add_ref([1])  # block 1 shared by two owners
    assert bm.ref_count(1) == 2
    bm.free(blocks)
    # block 0 had one owner; block 1 keeps its second owner
    assert bm.ref_count(0) == 0 and bm.ref_count(1) == 1
    assert _free_list(bm) == [2, 3, 0]
    bm.check_integrity(Counter({1: 1}))
    bm.free([1])
    assert _free_list(bm) == [2, 3, 0, 1]
    bm.check_integrity(Counter())


def test_double_free_and_add_ref_on_free_block_raise():
    bm = BlockManager(4)
    bm.allocate(1)
    bm.free([0])
    with pytest.raises(RuntimeError, match='double free of block 0'):
        bm.free([0])
    with pytest.raises(RuntimeError, match='add_ref on free block 2'):
        bm.add_ref([2])
    assert _free_list(bm) == [1, 2, 3, 0]


def test_block_manager_rejects_an_empty_pool():
    with pytest.raises(ValueError, match='num_blocks must be positive'):
        BlockManager(0)


def test_resolve_gpu_block_offsets_returns_a_copy_of_allocated_ids():
    bm = BlockManager(8, pages_per_block=4)
    bm.allocate(3)
    offsets = bm.resolve_gpu_block_offsets([2, 0])
    assert offsets.dtype.name == 'int64' and offsets.tolist() == [2, 0]
    assert bm.resolve_gpu_block_offsets([]).tolist() == []


@pytest.mark.parametrize('block_ids,message', [
    ([8], r'block id out of range \[0, 8\): \[8\]'),
    ([0, -1], r'block id out of range \[0, 8\): \[0, -1\]'),
    ([1, 5, 6], r'block ids not allocated: \[5, 6\]'),
], ids=['past-end', 'negative', 'unallocated'])
def test_resolve_gpu_block_offsets_rejects_invalid_ids(block_ids, message):
    bm = BlockManager(8)
    bm.allocate(3)  # [0, 1, 2] allocated
    with pytest.raises(ValueError, match=message):
        bm.resolve_gpu_block_offsets(block_ids)


def test_block_integrity_check_catches_disagreeing_owners():
    bm = BlockManager(4)
    bm.allocate(2)
    bm.check_integrity(Counter({0: 1, 1: 1}))
    with pytest.raises(AssertionError, match=r'\(1, 1, 0\)'):  # block 1: ref count 1, nobody owns it
        bm.check_integrity(Counter({0: 1}))
    with pytest.raises(AssertionError, match=r'\(0, 1, 2\)'):  # block 0: ref count 1, two owners claim it
        bm.check_integrity(Counter({0: 2, 1: 1}))


# ---- Scheduler: admission and growth ---------------------------------------------------------------------------
def test_prefill_takes_ceil_blocks_and_decode_grows_at_block_boundaries():
    sched = _scheduler(num_blocks=8, block_size=4)
    seq = _seq(1, 10, max_new_tokens=4)
    sched.add(seq)
    # 10 prompt tokens = 2 full blocks + 2 tokens
    assert _step(sched) == [(1, 10)]
    assert seq.block_ids == [0, 1, 2] and seq.num_computed == 10 and seq.num_tokens == 11
    assert _free_list(sched.block_manager) == [3, 4, 5, 6, 7]
    # decodes feed positions 10 and 11: still inside block 2 (2 full blocks + 4 tokens)
    assert _step(sched) == [(1, 1)]
    assert _step(sched) == [(1, 1)]
    assert seq.block_ids == [0, 1, 2]
    # position 12 opens a fourth block; the request then has 4 generated tokens and finishes
    assert _step(sched) == [(1, 1)]
    assert seq.status == SequenceStatus.FINISHED and seq.finish_reason == 'length'
    assert seq.block_ids == []
    assert _free_list(sched.block_manager) == [4, 5, 6, 7, 0, 1, 2, 3]
    assert not sched.has_unfinished


def test_waiting_request_is_admitted_when_blocks_are_released():
    sched = _scheduler(num_blocks=4, block_size=4)
    first, second = _seq(1, 12, max_new_tokens=1), _seq(2, 8, max_new_tokens=1)
    sched.add(first)
    sched.add(second)
    # first takes blocks [0, 1, 2] (3 full blocks); second needs 2, only [3] is free: it waits
    assert _step(sched) == [(1, 12)]
    assert first.is_finished and first.block_ids == []
    assert second.status == SequenceStatus.WAITING and sched.waiting == [second]
    # first's blocks came back to the tail of the free list: [3, 0, 1, 2]
    assert _step(sched) == [(2, 8)]
    assert not sched.has_unfinished
    assert _free_list(sched.block_manager) == [1, 2, 3, 0]


def test_only_the_first_prefill_of_a_batch_is_chunked():
    sched = _scheduler(max_prefill_token_num=6)
    short, long_, other = _seq(1, 3), _seq(2, 10), _seq(3, 4)
    for seq in (short, long_, other):
        sched.add(seq)
    # short (3) fits; long_ (10) would need a chunk of the remaining 3, but only the first prefill may be cut
    assert _step(sched) == [(1, 3)]
    assert sched.waiting == [long_, other]
    # short decodes (1); long_ is now the first prefill of the batch and is cut to the remaining 5
    assert _step(sched) == [(1, 1), (2, 5)]
    assert long_.num_computed == 5 and long_.block_ids == [1, 2]
    # long_ continues with its last 5 tokens; other (4) no longer fits the budget and is not chunked
    assert _step(sched) == [(1, 1), (2, 5)]
    assert long_.num_computed == 10 and long_.num_tokens == 11 and sched.waiting == [other]
    # decodes take 1 token each; other fits the remaining 4
    assert _step(sched) == [(1, 1), (2, 1), (3, 4)]
    while sched.has_unfinished:
        _step(sched)
    assert sched.block_manager.num_free == 8


def test_running_prefill_chunk_uses_the_whole_budget():
    sched = _scheduler(num_blocks=16, max_prefill_token_num=4)
    seq = _seq(1, 11, max_new_tokens=1)
    sched.add(seq)
    # 11 tokens through a budget of 4: 4 + 4 + 3, one block per chunk of 4
    assert _step(sched) == [(1, 4)]
    assert seq.block_ids == [0]
    assert _step(sched) == [(1, 4)]
    assert seq.block_ids == [0, 1]
    assert _step(sched) == [(1, 3)]
    assert seq.is_finished and sched.block_manager.num_free == 16


def test_decodes_are_batched_up_to_max_batch_size():
    sched = _scheduler(num_blocks=8, max_batch_size=2)
    seqs = [_seq(i, 2, max_new_tokens=3) for i in (1, 2, 3)]
    for seq in seqs:
        sched.add(seq)
    # the batch holds 2 sequences: the third waits although budget and blocks allow it
    assert _step(sched) == [(1, 2), (2, 2)]
    assert [s.block_ids for s in seqs] == [[0], [1], []]
    assert _step(sched) == [(1, 1), (2, 1)]
    assert _step(sched) == [(1, 1), (2, 1)]  # both finish (3 generated)
    assert _step(sched) == [(3, 2)]
    assert seqs[2].block_ids == [2]


def test_decode_batch_mixes_with_a_new_prefill():
    sched = _scheduler(num_blocks=8, max_prefill_token_num=8)
    a, b, c = _seq(1, 3), _seq(2, 3), _seq(3, 6)
    sched.add(a)
    sched.add(b)
    assert _step(sched) == [(1, 3), (2, 3)]
    sched.add(c)
    # two decodes (1 + 1) leave 6 of the budget for c's whole prompt
    assert _step(sched) == [(1, 1), (2, 1), (3, 6)]
    assert c.block_ids == [2, 3]


# ---- Scheduler: preemption and abort ---------------------------------------------------------------------------
def test_preemption_takes_the_latest_arrival_first():
    sched = _scheduler(num_blocks=3, block_size=4)
    a, b, c = _seq(1, 4), _seq(2, 4), _seq(3, 4)
    for seq in (a, b, c):
        sched.add(seq)
    # one full block each: [0], [1], [2]; the pool is empty
    assert _step(sched) == [(1, 4), (2, 4), (3, 4)]
    assert [s.block_ids for s in (a, b, c)] == [[0], [1], [2]]
    assert _free_list(sched.block_manager) == []
    # every decode needs a second block: a preempts c (the tail) and gets its block 2; b finds nobody behind it
    # that is not already scheduled, so b preempts itself
    assert _step(sched) == [(1, 1)]
    assert a.block_ids == [0, 2] and a.num_computed == 5
    assert (b.num_preemptions, c.num_preemptions) == (1, 1)
    assert b.block_ids == [] and c.block_ids == [] and b.num_computed == 0 and c.num_computed == 0
    assert sched.waiting == [b, c] and sched.running == [a]
    assert _free_list(sched.block_manager) == [1]
    # b must recompute prompt + its sampled token (5 tokens, 2 blocks): it waits for a to finish
    assert b.num_remaining == 5
    assert _step(sched) == [(1, 1)]
    assert sched.waiting == [b, c]
    while sched.has_unfinished:
        _step(sched)
    assert all(s.num_generated == 4 for s in (a, b, c))
    assert sched.block_manager.num_free == 3


def test_preempted_sequence_rejoins_the_queue_in_arrival_order():
    sched = _scheduler(num_blocks=2, block_size=4, max_prefill_token_num=4)
    a, b, c = _seq(1, 4), _seq(2, 4), _seq(3, 4)
    for seq in (a, b, c):
        sched.add(seq)
    assert _step(sched) == [(1, 4)]  # budget 4: a alone
    # a decodes into block 1; b would be cut to the 3 tokens left of the budget, but no block is free
    assert _step(sched) == [(1, 1)]
    # blocks [0, 1] belong to a; the pool is empty, b and c wait
    sched.preempt(a)
    sched.check_integrity()
    # a arrived first: it goes back to the head of the queue, before b and c
    assert sched.waiting == [a, b, c]
    assert _free_list(sched.block_manager) == [0, 1]


def test_abort_releases_blocks_of_running_and_waiting_sequences():
    sched = _scheduler(num_blocks=4, block_size=4)
    running, waiting = _seq(1, 9), _seq(2, 8)
    sched.add(running)
    sched.add(waiting)
    # running: 2 full blocks + 1 token in [0, 1, 2]; waiting needs 2 blocks, 1 is free
    assert _step(sched) == [(1, 9)]
    assert sched.waiting == [waiting]
    sched.abort(running)
    sched.check_integrity()
    assert running.status == SequenceStatus.ABORTED and running.finish_reason == 'abort'
    assert running.block_ids == [] and sched.running == []
    sched.abort(waiting)
    sched.check_integrity()
    assert waiting.status == SequenceStatus.ABORTED and sched.waiting == []
    assert not sched.has_unfinished
    assert _free_list(sched.block_manager) == [3, 0, 1, 2]


def test_state_slots_limit_admission_and_are_recycled():
    # 3 rows: dummy row 0 + 2 usable slots
    sched = _scheduler(num_blocks=8, num_state_slots=3)
    seqs = [_seq(i, 2, max_new_tokens=1) for i in (1, 2, 3)]
    for seq in seqs:
        sched.add(seq)
    assert _step(sched) == [(1, 2), (2, 2)]  # two slots, two admissions; both finish
    assert sched.state_manager.num_free == 2
    assert _step(sched) == [(3, 2)]
    assert not sched.has_unfinished and sched.block_manager.num_free == 8


def test_state_slots_are_handed_out_from_row_1():
    sched = _scheduler(num_blocks=8, num_state_slots=3)
    a, b = _seq(1, 2, max_new_tokens=2), _seq(2, 2, max_new_tokens=2)
    sched.add(a)
    sched.add(b)
    _step(sched)
    assert (a.state_slot, b.state_slot) == (1, 2)
    sched.abort(a)
    assert a.state_slot is None
    sched.check_integrity()


def test_scheduler_integrity_check_catches_a_leaked_block():
    sched = _scheduler(num_blocks=4)
    sched.add(_seq(1, 3))
    _step(sched)
    sched.block_manager.allocate(1)  # owned by nobody
    with pytest.raises(AssertionError, match='disagree'):
        sched.check_integrity()


def test_many_requests_under_pressure_all_finish_and_free_everything():
    sched = _scheduler(num_blocks=6, block_size=4, max_prefill_token_num=5, max_batch_size=3)
    seqs = [_seq(i, 1 + (5 * i) % 11, max_new_tokens=2 + i % 5) for i in range(1, 13)]
    for seq in seqs:
        sched.add(seq)
    for _ in range(500):
        if not sched.has_unfinished:
            break
        scheduled = _step(sched)
        assert scheduled, 'no progress'
        assert sum(n for _, n in scheduled) <= 5 or all(n == 1 for _, n in scheduled)
        assert len(scheduled) <= 3
    assert not sched.has_unfinished
    assert all(s.num_generated == s.sampling.max_new_tokens for s in seqs)
    assert sum(s.num_preemptions for s in seqs) > 0
    assert sched.block_manager.num_free == 6


@pytest.mark.parametrize('seed', range(4))
def test_long_and_short_id_lists_keep_the_per_block_semantics(seed):
    """`add_ref` / `free` over random lists short and long (the numpy pass from `_VECTOR_MIN` ids), duplicates
    included, against a plain per-element model: the same counts and the same free-list order, and a double free
    or an add_ref on a free block raised (a long list's leaving every count as it was)."""
    rng = random.Random(seed)
    bm, counts, free = BlockManager(64), [0] * 64, list(range(64))
    for _ in range(300):
        op = rng.choice(['allocate', 'add_ref', 'free'])
        live = [b for b in range(64) if counts[b] > 0]
        if op == 'allocate':
            num = rng.randrange(0, 24)
            if num > len(free):
                continue
            assert bm.allocate(num) == free[:num]
            for b in free[:num]:
                counts[b] = 1
            del free[:num]
            continue
        ids = [rng.choice(live) for _ in range(rng.randrange(0, 40))] if live else []
        if rng.random() < 0.1:
            ids.insert(rng.randrange(len(ids) + 1), rng.randrange(64))   # maybe a free block: must raise
        want = list(counts)
        for b in ids:
            want[b] += 1 if op == 'add_ref' else -1
        bad = any(counts[b] <= 0 for b in ids) if op == 'add_ref' else any(c < 0 for c in want)
        if bad:
            with pytest.raises(RuntimeError, match='add_ref on free block' if op == 'add_ref' else 'double free'):
                getattr(bm, op)(ids)
            if len(ids) >= block_manager._VECTOR_MIN:
                assert [bm.ref_count(b) for b in range(64)] == counts, 'a long list left a count changed'
            else:   # the short loop stops at the bad id: rebuild the model from the manager
                counts = [bm.ref_count(b) for b in range(64)]
                free = _free_list(bm)
            continue
        getattr(bm, op)(ids)
        if op == 'free':
            last = {b: i for i, b in enumerate(ids)}
            free += [b for i, b in enumerate(ids) if want[b] == 0 and counts[b] > 0 and last[b] == i]
        counts = want
        assert [bm.ref_count(b) for b in range(64)] == counts
        assert _free_list(bm) == free
