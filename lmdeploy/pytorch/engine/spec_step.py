"""The engine's speculative (MTP) step: glue between the scheduler's records and the device work of `spec_decode`.

Owns the acceptance counters (`SpecDecodeStats`). Order inside `EngineStep._run_forward`, with speculation on:
`forward` (verify forward: restores, target, hidden rows, acceptance) -> `Scheduler.update` (verified runs appended,
state fix-ups planned) -> `draft` (fix-ups, the head's catch-up, save copies, drafts: launched) -> deliver ->
`Scheduler.commit` ... as in plain decoding -> `settle()` (the drafts' host read, onto the sequences). A failure in
either call fails the batch (`Scheduler.cancel`); a failed `settle()` only leaves the sequences without drafts.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..messages import SchedulerSequence
from ..model_inputs import ModelInputs, SamplingInputs
from ..paging.scheduler_output import SampledToken, SchedulerOutput, SequenceUpdate
from .cache_inputs import CacheCheckpointInputs
from .engine_stats import SpecDecodeStats
from .spec_decode import VerifyOutput, sample_params
from .spec_inputs import VerifyPlan, can_speculate, plan_chain, plan_head, plan_verify, uniform_draft_slots


class SpecForwardResult:
    """What the verify forward gave the engine: the emitted run of each sampled sequence."""
    __slots__ = ('verify', 'plan', 'cache_inputs', 'logits', 'routed_experts')

    def __init__(self, verify: VerifyOutput, plan: VerifyPlan, cache_inputs, logits):
        self.verify, self.plan, self.cache_inputs = verify, plan, cache_inputs
        self.logits = logits          # [S, V] at each sampled sequence's last real token (prompt-end logits)
        self.routed_experts = None

    def rows(self, sampled: list[SchedulerSequence]) -> list[SampledToken]:
        logprobs, run_logprobs = self.verify.logprobs, self.verify.run_logprobs
        rows = []
        for i, (seq, run) in enumerate(zip(sampled, self.verify.runs)):
            per_token = run_logprobs[i] if run_logprobs else None
            if per_token is not None:  # a drafting row: the logprobs of every token of its run
                rows.append(SampledToken(seq, run[-1], per_token[-1], tuple(run[:-1]), tuple(per_token[:-1])))
            else:
                rows.append(SampledToken(seq, run[-1], logprobs[i] if logprobs and len(run) == 1 else None,
                                         tuple(run[:-1])))
        return rows


class SpeculativeStep:

    def __init__(self, agent, inputs_maker, num_draft_tokens: int, session_len: int):
        self.agent = agent
        self.inputs_maker = inputs_maker
        self.k = num_draft_tokens
        self.session_len = session_len
        self.stats = SpecDecodeStats()

    def set_draft_override(self, override) -> None:
        """Replace the head's greedy proposals (`spec_decode.DraftOverride`; None: the head's own). For forced-
        acceptance tests and benchmarks: the head still runs, so its cost and its KV writes are unchanged."""
        self.agent.spec.draft_override = override

    def forward(self, sched: SchedulerOutput, inputs: ModelInputs, sampled: list[SchedulerSequence],
                sampling: SamplingInputs, cache_inputs: CacheCheckpointInputs | None,
                generators: dict[int, torch.Generator], collect: bool) -> SpecForwardResult:
        plan = plan_verify(sched, inputs, sampled)
        slots = uniform_draft_slots(sched, inputs, self.k)
        if slots is not None:  # the same cuts in the shape-only form (verify CUDA graphs replay it)
            inputs.state_cuts, inputs.draft_state_slots = None, slots
        params = [None if seq.sampling.is_greedy else sample_params(seq, generators) for seq in sampled]
        verify, device_cache_inputs, logits = self.agent.forward_verify(inputs, sampling, cache_inputs, plan,
                                                                        params, collect)
        drafted = [d for d in plan.num_drafts if d]
        self.stats = SpecDecodeStats(
            self.stats.num_verify_rows + len(drafted), self.stats.num_draft_tokens + sum(drafted),
            self.stats.num_accepted_tokens + sum(verify.num_accepted))
        return SpecForwardResult(verify, plan, device_cache_inputs, logits)

    def draft(self, sched: SchedulerOutput, result: SpecForwardResult | None, updates: list[SequenceUpdate],
              generators: dict[int, torch.Generator], collected: dict[int, list[torch.Tensor]]
              ) -> Callable[[], None] | None:
        """After `Scheduler.update`: fix-ups, catch-up, saves and drafts, launched. Returns `settle()`, which puts
        the next drafts onto the sequences (their host read); the engine calls it after its bookkeeping and before
        the next schedule. None: nothing to settle."""
        if result is None:
            return None
        stopped = {u.seq.seq_id for u in updates if u.finish_reason is not None}
        sampled_ids = {u.seq.seq_id for u in updates}
        plan = result.plan
        if result.verify.logits is not None:
            self._collect(sched, plan, result.verify.logits, collected)

        def wants_drafts(seq: SchedulerSequence) -> bool:
            return (seq.seq_id in sampled_ids and seq.seq_id not in stopped and can_speculate(seq)
                    and seq.num_computed + 2 * self.k <= self.session_len)

        maker = self.inputs_maker
        head = plan_head(sched, plan, maker.page_table, maker.kernel_block_size,
                         result.verify.hidden.size(0) - len(plan.overlap_slots), wants_drafts)
        for seq in head.seqs:
            seq.needs_draft_overlap = False
        drafting = [head.seqs[i] for i in head.drafting]
        params = [None if seq.sampling.is_greedy else sample_params(seq, generators) for seq in drafting]
        chains, whole = self._chains(drafting, params)
        fixups = CacheCheckpointInputs(state_restore_plan=torch.tensor(sched.draft_fixups, dtype=torch.int64).T
                                       .contiguous()) if sched.draft_fixups else None
        verified = maker.make_cache_inputs(sched.verified)  # decode-interval checkpoints at committed steps
        pending = self.agent.draft(fixups, head, result.verify.hidden, chains, params, result.cache_inputs,
                                   verified, greedy_chain=whole)

        def settle() -> None:
            ids, probs = pending.resolve()
            for seq, row, prob in zip(drafting, ids, probs):
                if not seq.is_finished:  # aborted or failed since the launch: no drafts
                    seq.draft_ids, seq.draft_probs = list(row), prob
        return settle

    def _chains(self, drafting: list[SchedulerSequence], params: list) -> tuple[list[ModelInputs], bool]:
        """The chained steps' inputs, and whether the whole greedy chain replays at once (`spec_chain`): then only
        chained step 1's rows are planned (the graph derives the later ones on the device)."""
        if not drafting or self.k < 2:
            return [], False
        maker = self.inputs_maker
        first = plan_chain(drafting, 1, maker.page_table, maker.kernel_block_size)
        if all(p is None for p in params) and self.agent.greedy_chain_fits(first):
            return [first], True
        return [first] + [plan_chain(drafting, step, maker.page_table, maker.kernel_block_size)
                          for step in range(2, self.k)], False

    @staticmethod
    def _collect(sched: SchedulerOutput, plan: VerifyPlan, logits: torch.Tensor,
                 collected: dict[int, list[torch.Tensor]]) -> None:
        """Logits of the committed fed tokens of collecting sequences (what plain decoding would have fed)."""
        for b, seq in enumerate(sched.seqs):
            if seq.seq_id in collected:
                committed = seq.num_computed - plan.old_computed[b]
                collected[seq.seq_id].append(logits[plan.starts[b]:plan.starts[b] + committed])
