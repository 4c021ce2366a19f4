"""Harness for the paging-layer prefix-cache tests: a scheduler over BlockTrie + BlockManager + StateManager
driven without a model.

No model runs. A step makes the engine's scheduler calls: `schedule()` -> (the "forward" samples `SAMPLED` for every
sequence that fed its last token and every whole-prompt hit) -> `update()` -> `commit()` -> `release()`.
`check_integrity()` runs before and after every step.

Geometry: block_size 4, so "2 full blocks + 2 tokens" is a 10-token prompt. Blocks are handed out lowest id first
and freed ids go to the back of the free list; state slots are handed out lowest first and a freed slot is the
next one handed out (row 0 is the dummy).
"""
from __future__ import annotations

from lmdeploy import PrefixCacheConfig
from lmdeploy.pytorch.config import CacheConfig, SchedulerConfig
from lmdeploy.pytorch.messages import MultiModalSpan, SamplingParams, SchedulerSequence
from lmdeploy.pytorch.paging.block_trie.node import NodeStateCheckpoint
from lmdeploy.pytorch.paging.scheduler import Scheduler, SchedulerOutput
from lmdeploy.pytorch.paging.scheduler_output import SampledToken

BS = 4
SAMPLED = 999  # the token every simulated forward samples
# The base design: checkpoints at prefill / chunk ends (+ opt-in decode interval), matching leaves one token,
# plain LRU. The policies layered on top (each on by default in the engine) are switched on per test.
BASE = dict(reply_checkpoints=False, prompt_logits=False, branch_checkpoints=False, value_eviction=False,
            prefill_state_interval=0)


# ---- harness ----------------------------------------------------------------------------------------------------
def make_scheduler(num_blocks: int = 16, num_state_slots: int = 8, max_prefill_token_num: int = 64,
                   max_batch_size: int = 8, hybrid: bool = True, exact: bool = True,
                   decode_interval: int = 0, **policy) -> Scheduler:
    """`policy`: `PytorchEngineConfig`'s flat `prefix_cache_*` names, switched on (or set) on top of `BASE`."""
    knobs = {**BASE, **{name.removeprefix('prefix_cache_'): value for name, value in policy.items()}}
    prefix_cache = PrefixCacheConfig(checkpoint_mode='exact' if exact else 'aligned',
                                     decode_state_interval=decode_interval, **knobs).resolved(BS)
    cache = CacheConfig(block_size=BS, kernel_block_size=BS, num_blocks=num_blocks,
                        num_state_slots=num_state_slots if hybrid else 0, prefix_cache=prefix_cache)
    config = SchedulerConfig(max_batch_size=max_batch_size, max_prefill_token_num=max_prefill_token_num,
                             session_len=num_blocks * BS)
    return Scheduler(config, cache, needs_state=hybrid)


_ids = iter(range(1, 1 << 30))


def make_seq(tokens, max_new_tokens: int = 1, mm_spans: tuple[MultiModalSpan, ...] = (),
             adapter_name: str | None = None) -> SchedulerSequence:
    tokens = list(tokens)
    return SchedulerSequence(seq_id=next(_ids), token_ids=tokens, num_prompt_tokens=len(tokens),
                             sampling=SamplingParams(max_new_tokens=max_new_tokens), mm_spans=mm_spans,
                             adapter_name=adapter_name)


def begin(scheduler: Scheduler) -> SchedulerOutput:
    """The scheduling half of a step (inspect the plans, then call `end`)."""
    scheduler.check_integrity()
    out = scheduler.schedule()
    scheduler.check_integrity()
    return out


def sampled_rows(out: SchedulerOutput, token: int = SAMPLED) -> list[SampledToken]:
    """What the simulated forward samples: `token` for every sequence that feeds its last token (in batch order),
    then for every whole-prompt hit."""
    fed = [seq for seq, n in zip(out.seqs, out.num_new_tokens) if seq.num_computed + n == seq.num_tokens]
    return [SampledToken(seq, token, None) for seq in fed + [seq for seq, _ in out.logits_hits]]


def end(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """The forward-done half of a step: the scheduler's `update` -> `commit` -> `release`."""
    scheduler.release(scheduler.commit(out, scheduler.update(out, sampled_rows(out))))
    scheduler.check_integrity()
    assert_trie_consistent(scheduler)


def step(scheduler: Scheduler) -> SchedulerOutput:
    """One simulated engine step."""
    out = begin(scheduler)
    end(scheduler, out)
    return out


def run(scheduler: Scheduler, *seqs: SchedulerSequence) -> list[SchedulerOutput]:
    """Queue `seqs` and step until nothing is left; returns every step's output."""
    for seq in seqs:
        scheduler.add(seq)
    outs = []
    while scheduler.has_unfinished:
        assert len(outs) < 200, 'still busy after 200 steps (a request is never admitted?)'
        outs.append(step(scheduler))
    assert all(seq.is_finished for seq in seqs)
    return outs


def assert_trie_consistent(scheduler: Scheduler) -> None:
    """Every attached node is reachable from a root, and every published checkpoint hangs on a reachable anchor
    under its own key (so leaf eviction sees it)."""
    trie = scheduler.trie
    reachable, stack = set(), list(trie.kv.roots.values())
    while stack:
        node = stack.pop()
        assert node.attached
        for child in node.children.values():
            reachable.add(child)
            stack.append(child)
    assert len(reachable) == trie.kv.num_nodes, 'nodes attached under an evicted parent'
    if trie.checkpoints is not None:
        for ck in trie.checkpoints.live():
            if ck.published:
                assert ck.anchor.is_root or ck.anchor in reachable
                assert ck.anchor.checkpoints.get((ck.step, ck.tail_hash)) is ck


def live(scheduler: Scheduler) -> list[NodeStateCheckpoint]:
    return sorted(scheduler.trie.checkpoints.live(), key=lambda ck: ck.step)


def free_blocks(scheduler: Scheduler) -> list[int]:
    return list(scheduler.block_manager._free)


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))
