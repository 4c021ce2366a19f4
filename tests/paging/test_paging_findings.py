"""Findings of the paging state machine (test_fuzz_paging.py) pinned down as deterministic tests: scheduler
livelocks it found, replayed step by step on a tiny pool."""
from __future__ import annotations

from lmdeploy import PrefixCacheConfig
from lmdeploy.pytorch.config import CacheConfig, SchedulerConfig
from lmdeploy.pytorch.messages import MultiModalSpan, SamplingParams, SchedulerSequence
from lmdeploy.pytorch.paging.scheduler import Scheduler
from lmdeploy.pytorch.paging.scheduler_output import SampledToken


def _scheduler(num_blocks: int, block_size: int = 4, max_batch_size: int = 1, budget: int = 0,
               max_prefill: int = 64, policies: bool = False) -> Scheduler:
    prefix_cache = PrefixCacheConfig(reply_checkpoints=policies, prompt_logits=policies, branch_checkpoints=policies,
                                     value_eviction=policies, prefill_state_interval=0)
    cache = CacheConfig(block_size=block_size, kernel_block_size=block_size, num_blocks=num_blocks,
                        num_state_slots=1 + max_batch_size + 1 + budget, prefix_cache=prefix_cache)
    config = SchedulerConfig(max_batch_size=max_batch_size, max_prefill_token_num=max_prefill,
                             session_len=num_blocks * block_size)
    return Scheduler(config, cache, needs_state=True)


def _run_to_idle(s: Scheduler, max_steps: int = 50) -> None:
    for _ in range(max_steps):
        if not s.has_unfinished:
            return
        out = s.schedule()
        fed = [seq for seq, n in zip(out.seqs, out.num_new_tokens) if seq.num_computed + n == seq.num_tokens]
        rows = [SampledToken(seq, 0, None) for seq in fed + [seq for seq, _ in out.logits_hits]]
        s.release(s.commit(out, s.update(out, rows)))  # max_new_tokens=1: every sampled sequence finishes
        s.check_integrity()


def test_hit_needing_the_whole_pool_is_admitted_cold():
    # 5 blocks of 4 tokens (session_len 20). A 10-token prompt leaves trie nodes for [0, 8) and a partial checkpoint
    # at 10 (frozen block). A 19-token prompt extending it needs all 5 blocks: as a hit it keeps the 2 shared blocks
    # and pins the frozen one, so only 2 of the 3 blocks it needs can be found; it waits forever, and so does every
    # request queued behind it. Evicting the checkpoint and admitting it cold would fit.
    s = _scheduler(num_blocks=5)
    s.add(SchedulerSequence(seq_id=1, token_ids=list(range(10)), num_prompt_tokens=10,
                            sampling=SamplingParams(max_new_tokens=1)))
    _run_to_idle(s)
    assert [ck.step for ck in s.trie.checkpoints.live()] == [10]
    long = SchedulerSequence(seq_id=2, token_ids=list(range(10)) + list(range(100, 109)), num_prompt_tokens=19,
                             sampling=SamplingParams(max_new_tokens=1))
    s.add(long)
    _run_to_idle(s)
    assert long.is_finished, f'still {long.status.name} after 50 steps'


def test_request_is_not_starved_by_duplicate_interior_nodes():
    # Found by the state machine (2-token blocks, 7 blocks, one running request, 2 usable state rows, 3-token
    # prefill chunks). A and B (11 zeros) leave trie nodes for [0, 8). C has the same tokens but an image at [8, 10),
    # so none of the checkpoints matches and C recomputes [0, 8) into private blocks; at attach it deduplicates onto
    # the nodes of [0, 4) while the deeper nodes, evicted meanwhile, are re-created from C's own blocks. The nodes of
    # [0, 4) are now interior nodes over C's blocks: only the trie references them, yet no leaf above them is
    # evictable. C (6 blocks) needs its 6th block, finds none, preempts itself, recomputes and ends in the same
    # state: forever.
    s = _scheduler(num_blocks=7, block_size=2, max_prefill=3)
    for seq_id, spans in ((1, ()), (2, ()), (3, (MultiModalSpan(8, 10, 1),))):
        s.add(SchedulerSequence(seq_id=seq_id, token_ids=[0] * 11, num_prompt_tokens=11,
                                sampling=SamplingParams(max_new_tokens=1), mm_spans=spans))
    _run_to_idle(s, max_steps=60)
    assert not s.has_unfinished, f'{len(s.running)} running, {len(s.waiting)} waiting after 60 steps'
