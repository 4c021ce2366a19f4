"""The scheduler with speculative decoding (K draft tokens), on the CPU without a model: spare state rows, verify
pieces with a state cut per draft position, verified runs with stops inside them, the state fix-up, and the private
copy of an aligned hit's last block. `check_integrity()` after every step."""
from __future__ import annotations

from lmdeploy.prefix_cache_config import PrefixCacheConfig
from lmdeploy.pytorch.config import CacheConfig, SchedulerConfig
from lmdeploy.pytorch.messages import SamplingParams, SchedulerSequence
from lmdeploy.pytorch.paging.scheduler import Scheduler
from lmdeploy.pytorch.paging.scheduler_output import SampledToken

K, BLOCK = 2, 4


def _scheduler(cache: bool = False, num_blocks: int = 16) -> Scheduler:
    prefix = PrefixCacheConfig().resolved(BLOCK) if cache else None
    config = CacheConfig(block_size=BLOCK, kernel_block_size=BLOCK, num_blocks=num_blocks, num_state_slots=16,
                         prefix_cache=prefix)
    return Scheduler(SchedulerConfig(max_batch_size=4, max_prefill_token_num=64, session_len=num_blocks * BLOCK),
                     config, needs_state=True, num_draft_tokens=K)


def _seq(seq_id: int, prompt: list[int], **sampling) -> SchedulerSequence:
    return SchedulerSequence(seq_id=seq_id, token_ids=list(prompt), num_prompt_tokens=len(prompt),
                             sampling=SamplingParams(**{'max_new_tokens': 16, **sampling}))


def _step(s: Scheduler, runs: dict[int, list[int]]):
    """One step; `runs[seq_id]` is the verified run a sampled sequence emits (accepted drafts, then one token)."""
    out = s.schedule()
    s.check_integrity()
    rows = [SampledToken(seq, runs[seq.seq_id][-1], None, tuple(runs[seq.seq_id][:-1]))
            for b, (seq, n) in enumerate(zip(out.seqs, out.num_new_tokens))
            if seq.num_computed + n - out.drafts_of(b) == seq.num_tokens]
    updates = s.update(out, rows)
    s.release(s.commit(out, updates))
    s.check_integrity()
    return out, updates


def test_verify_piece_cuts_after_each_draft_and_commits_the_verified_run():
    s = _scheduler()
    seq = _seq(1, range(10, 16))                      # 6 prompt tokens
    s.add(seq)
    out, _ = _step(s, {1: [50]})                      # prefill; first token 50
    assert len(seq.draft_slots) == K and seq.state_slot not in seq.draft_slots
    assert out.num_drafts == [0] and seq.num_computed == 6
    seq.draft_ids = [51, 52]                          # what the head proposed
    out, (update,) = _step(s, {1: [51, 60]})          # d_1 accepted, d_2 replaced by 60
    assert out.num_new_tokens == [3] and out.num_drafts == [2]
    assert [(c.step, c.slot) for c in out.draft_cuts] == [(7, seq.draft_slots[0]), (8, seq.draft_slots[1])]
    assert update.new_token_ids == [51, 60] and seq.token_ids[6:] == [50, 51, 60]
    assert seq.num_computed == 8                      # 50 and 51 committed; 60 is the next token to feed
    assert out.draft_fixups == [(seq.draft_slots[1], seq.state_slot)]  # the state after 2 of 3 fed tokens
    assert seq.draft_ids == []
    seq.draft_ids = [61, 62]
    out, _ = _step(s, {1: [61, 62, 63]})              # everything accepted: the runtime row is already right
    assert seq.num_computed == 11 and out.draft_fixups == []
    # blocks cover the last verify piece (from step 8) plus K - 1 chained draft positions
    assert len(seq.block_ids) * BLOCK >= 8 + (1 + K) + K - 1


def test_a_stop_inside_the_accepted_run_ends_it_there():
    s = _scheduler()
    seq = _seq(1, range(10, 16), stop_token_ids=[71])
    s.add(seq)
    _step(s, {1: [50]})
    seq.draft_ids = [70, 71]
    spare, runtime = list(seq.draft_slots), seq.state_slot
    out, (update,) = _step(s, {1: [70, 71, 72]})      # 71 is a stop id: 72 is dropped, 71 not sent
    assert update.finish_reason == 'stop' and update.new_token_ids == [70]
    assert seq.token_ids[6:] == [50, 70, 71]
    assert seq.num_computed == 8                      # 50, 70 consumed (as plain decoding would have fed them)
    assert out.draft_fixups == [(spare[1], runtime)]  # the reply checkpoint reads the state after them
    assert seq.is_finished and not s.running
    assert s.state_manager.num_free == s.state_manager.num_usable  # runtime and spare rows freed


def test_max_new_tokens_inside_the_run():
    s = _scheduler()
    seq = _seq(1, range(10, 16), max_new_tokens=2)
    s.add(seq)
    _step(s, {1: [50]})
    seq.draft_ids = [51, 52]
    _, (update,) = _step(s, {1: [51, 52, 53]})
    assert update.finish_reason == 'length' and update.new_token_ids == [51]


def test_an_aligned_hit_copies_its_last_shared_block_into_a_private_one():
    s = _scheduler(cache=True)
    first = _seq(1, range(10, 18), max_new_tokens=1)  # 8 tokens: 2 full blocks, prompt-end checkpoint at 8
    s.add(first)
    _step(s, {1: [50]})
    second = _seq(2, [*range(10, 18), 90, 91])
    s.add(second)
    out = s.schedule()
    s.check_integrity()
    assert second.num_computed == 8 and second.needs_draft_overlap
    trie_blocks = set(s.prefix_cache.owners()[0])
    last_shared = [src for src, _ in out.kv_restores if src in trie_blocks]
    assert len(last_shared) == 1 and out.block_pins == last_shared
    assert second.block_ids[1] not in trie_blocks      # block [4, 8) is private: the head rewrites position 7
    assert second.block_ids[0] in trie_blocks          # block [0, 4) stays shared
    rows = [SampledToken(second, 60, None)]
    s.release(s.commit(out, s.update(out, rows)))
    assert out.block_pins == []
    s.check_integrity()
