"""One engine step after `Engine.step()` took the step lock: drain commands -> schedule -> the forward and its
bookkeeping, synchronous (`_run_forward`) or with async scheduling (`_run_async`: `_launch` this step, `_settle`
the one in flight; `async_scheduling.py` holds the device-side feed and the in-flight record).

Synchronous order: make inputs -> forward -> update -> deliver -> commit -> copy -> release (the scheduler's calls
are described in `paging/scheduler.py`). Tokens and stops are delivered before the bookkeeping the next step needs.

`EngineStep` is a base of `Engine` (`engine.py`) and owns only the in-flight step (`_inflight`,
`num_overlapped_steps`); it names the step's forward in `_batch` (for its stats record). It uses the engine's parts
(scheduler, agent, inputs maker, routes recorder, speculative step, per-request generators and collected logits)
and its request outputs (`_deliver`, `_fail`, `_finish_output`, `_error_output`, `_update_output`, `_reject`,
`_deliver_all`, `_forget`). It never builds or closes any of them.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..messages import SchedulerSequence
from ..paging.scheduler_output import ReplyPlan, SampledToken, SchedulerOutput, SequenceUpdate
from .async_scheduling import LaunchedStep, build_feed, is_deferrable, needs_host_tokens
from .engine_stats import step_batch
from .inputs_maker import drop_sampled_rows, make_sampling_inputs
from .request import EngineOutput
from .spec_step import SpecForwardResult
from .tp_workers import TensorParallelFailure
from .trace import phase

logger = logging.getLogger('lmdeploy')


class EngineStep:
    """The step of `Engine` (see the module docstring for what it uses of the engine)."""

    def _init_async_state(self) -> None:
        # Async scheduling: the launched forward whose tokens are not settled yet (None: nothing in flight).
        cfg = self.engine_config
        self.async_scheduling = cfg.async_scheduling if cfg.async_scheduling is not None else (
            cfg.device_type == 'cuda' and cfg.tp == 1 and cfg.speculative_config is None
            and not cfg.prefix_cache_decode_state_interval)
        self._inflight: LaunchedStep | None = None
        self.num_overlapped_steps = 0  # steps launched while another was in flight

    def _step(self) -> list[EngineOutput]:
        with self._lock:
            commands, self._commands = self._commands, []
        outputs = [out for seq_id, command in commands for out in self._run_command(seq_id, command)]
        for out in outputs:
            self._deliver(out)
        if self.fatal_error is not None:
            self.last_step_idle = True
            self._inflight = None
            return outputs + self._fail_everything(self.fatal_error)
        if self._inflight is not None and not self.scheduler.can_schedule_ahead():
            outputs += self._settle(self._take_inflight())  # no room to schedule without preempting pending tokens
        with phase('schedule'):
            sched = self.scheduler.schedule()
        self._batch = step_batch(sched)
        for seq, error in sched.rejected:  # faults while scheduling fail their own requests
            logger.error('request %d: %s', seq.seq_id, error)
            out = self._error_output(seq, error)
            self._deliver(out)
            outputs.append(out)
        # True when this step ran nothing on the device (the loop thread then backs off instead of spinning).
        self.last_step_idle = sched.is_empty and not sched.has_copies and self._inflight is None
        if not (sched.is_empty and not sched.has_copies):
            # both deliver their outputs themselves, before their bookkeeping
            outputs += self._run_async(sched) if self.async_scheduling else self._run_forward(sched)
        elif self._inflight is not None:
            outputs += self._settle(self._take_inflight())
        elif self.scheduler.waiting and not self.scheduler.running:
            # Nothing runs and the head of the queue still cannot be admitted: it never will be (everything else
            # the pools hold is evictable), so fail it instead of spinning.
            seq = self.scheduler.waiting[0]
            out = self._fail(seq, 'the request does not fit in the KV cache / state pool')
            self._deliver(out)
            outputs.append(out)
        return outputs

    def _run_forward(self, sched: SchedulerOutput) -> list[EngineOutput]:
        """forward -> update -> deliver -> commit -> copy -> release (see `Scheduler`). Tokens and stops are
        delivered before the prefix cache's bookkeeping, which the next step needs but the client does not wait
        for; a failed forward fails its batch only. Requests whose sampling inputs cannot be built are computed and
        cached like the others, then fail alone (blocks and slot released)."""
        rejected: list[tuple[SchedulerSequence, str]] = []
        try:
            result, sampled = self._forward(sched, rejected)
            rows = self._sampled_rows(result, sampled) + self._sample_logits_hits(sched.logits_hits, rejected)
        except Exception as exc:  # the engine keeps serving (unless a tensor-parallel rank failed)
            return self._fail_forward(sched, exc)
        if result is not None:
            self.routes.store(sched.seqs, sched.num_new_tokens, result.routed_experts)
        updates = self.scheduler.update(sched, rows)
        settle_drafts = None
        if self.speculative is not None:
            try:  # fix-ups, the head's catch-up, save copies, the next drafts (launched; read back below)
                settle_drafts = self.speculative.draft(sched, result, updates, self._generators,
                                                       self._collected_logits)
            except Exception as exc:
                logger.exception('drafting failed')
                return self._deliver_all([self._error_output(seq, f'forward failed: {exc}')
                                          for seq in self.scheduler.cancel(sched)])
        outputs = self._deliver_and_commit(sched, updates, sampled, result)
        if settle_drafts is not None:
            self._settle_drafts(settle_drafts)
        return outputs + self._deliver_all([self._reject(seq, error) for seq, error in rejected])

    @staticmethod
    def _settle_drafts(settle) -> None:
        """The drafts' host read, after the bookkeeping above ran while the device drafted. A failure here leaves
        the sequences without drafts: every draft is verified, so the output stays exact (only slower)."""
        try:
            settle()
        except Exception:  # noqa: BLE001 - drafts are an optimisation; the next forward surfaces a device fault
            logger.exception('reading the drafts failed; the sequences decode without drafts')

    # ---- async scheduling ---------------------------------------------------------------------------------------
    def _take_inflight(self) -> LaunchedStep:
        launched, self._inflight = self._inflight, None
        return launched

    def _run_async(self, sched: SchedulerOutput) -> list[EngineOutput]:
        """Launch this step's forward (fed on the device with the tokens of the one in flight), then settle the one
        in flight while the device runs this one; this one stays in flight when it is deferrable."""
        prev = self._take_inflight() if self._inflight is not None else None
        self.num_overlapped_steps += prev is not None
        try:
            launched = self._launch(sched, prev)
        except Exception as exc:  # this batch fails; the one in flight still settles
            outputs = self._fail_forward(sched, exc)
            return (self._settle(prev) if prev is not None else []) + outputs
        outputs = self._settle(prev) if prev is not None else []
        if launched.deferrable and self.fatal_error is None:
            self._inflight = launched
            return outputs
        return outputs + self._settle(launched)

    def _launch(self, sched: SchedulerOutput, prev: LaunchedStep | None) -> LaunchedStep:
        """Restore copies, forward, save copies, sampling (left on the device when the step is deferrable), then
        `Scheduler.advance`."""
        rejected: list[tuple[SchedulerSequence, str]] = []
        # (recording routes needs the host tokens: one check for the batch, not one per sequence)
        host_bound = self.routes.wants(sched.seqs) or any(
            needs_host_tokens(seq, seq.seq_id in self._collected_logits, False) for seq in sched.seqs)
        result, sampled = self._forward(sched, rejected, prev, defer=not host_bound)
        hits = self._sample_logits_hits(sched.logits_hits, rejected)
        if result is not None:
            self.routes.store(sched.seqs, sched.num_new_tokens, result.routed_experts)
        self.scheduler.advance(sched, sampled + [row.seq for row in hits])
        return LaunchedStep(sched, sampled, result, hits, rejected,
                            is_deferrable(sched, result, rejected, host_bound))

    def _settle(self, launched: LaunchedStep) -> list[EngineOutput]:
        """The launched step's tokens to the host: settle (append, stops), deliver, commit, copy, release."""
        sched, result = launched.sched, launched.result
        try:
            rows = self._sampled_rows(result, launched.sampled) + launched.hits
        except Exception as exc:  # the device failed under this forward
            return self._fail_forward(sched, exc)
        updates = self.scheduler.settle(rows)
        outputs = self._deliver_and_commit(sched, updates, launched.sampled, result)
        return outputs + self._deliver_all([self._reject(seq, error) for seq, error in launched.rejected])

    def _deliver_and_commit(self, sched: SchedulerOutput, updates: list[SequenceUpdate],
                            sampled: list[SchedulerSequence], result) -> list[EngineOutput]:
        """Deliver the updates' outputs, then the bookkeeping the next step needs and no client waits for: commit,
        the reply checkpoints' copies, release. Returns the delivered outputs."""
        with phase('deliver'):
            outputs = self._deliver_all([self._update_output(update) for update in updates])
        with phase('commit'):
            plan = self.scheduler.commit(sched, updates, self._prompt_logits(sampled, result))
            self.scheduler.release(plan, copied=self._copy(plan))
        for seq, _ in plan.finishing:
            self._forget(seq.seq_id)
        return outputs

    def _fail_forward(self, sched: SchedulerOutput, exc: Exception) -> list[EngineOutput]:
        logger.error('forward failed', exc_info=exc)
        outputs = self._deliver_all([self._error_output(seq, f'forward failed: {exc}')
                                     for seq in self.scheduler.cancel(sched)])
        if isinstance(exc, TensorParallelFailure):
            self._fatal = str(exc)
            outputs += self._fail_everything(self._fatal)
        return outputs

    # ---- the forward ------------------------------------------------------------------------------------------
    def _forward(self, sched: SchedulerOutput, rejected: list[tuple[SchedulerSequence, str]],
                 prev: LaunchedStep | None = None, defer: bool = False):
        """Restore copies, forward, save copies, sampling of the fed rows. Returns the forward's output (None: no
        forward) and the sequences it sampled, in row order; rows whose sampling inputs fail go to `rejected`.
        Async scheduling: `prev` is the step in flight whose tokens some pieces feed; `defer` leaves the sampled ids
        on the device (a plain forward only)."""
        sampled, result = [], None
        with phase('make_inputs'):
            cache_inputs = self.inputs_maker.make_cache_inputs(sched)
            if sched.seqs:
                inputs, sampled = self.inputs_maker.make(sched)
                inputs.record_routed_experts = self.routes.wants(sched.seqs)
                sampling, errors = make_sampling_inputs(sampled, self._generators)
                if errors:  # those requests fail alone after this forward; the others sample as usual
                    rejected += [(sampled[i], error) for i, error in errors.items()]
                    sampled = drop_sampled_rows(inputs, sampled, errors)
                collected = self._collected_logits
                collect = [seq.seq_id in collected for seq in sched.seqs] if collected else [False] * len(sched.seqs)
                feed = build_feed(sched, sampled, prev)
        if sched.seqs:
            if self.speculative is not None:
                result = self.speculative.forward(sched, inputs, sampled, sampling, cache_inputs, self._generators,
                                                  any(collect))
            elif any(collect):
                result = self._forward_collecting(inputs, sampling, cache_inputs, sched, collect, feed)
            elif feed is not None or defer:
                result = self.agent.forward(inputs, sampling, cache_inputs, feed=feed, defer=defer)
            else:
                result = self.agent.forward(inputs, sampling, cache_inputs)
        elif cache_inputs is not None:
            self.agent.copy_only(cache_inputs)
        return result, sampled

    @staticmethod
    def _sampled_rows(result, sampled: list[SchedulerSequence]) -> list[SampledToken]:
        if isinstance(result, SpecForwardResult):
            return result.rows(sampled)
        with phase('resolve'):
            ids = result.resolve() if result is not None else []
        return [SampledToken(seq, ids[i], result.logprobs[i] if result.logprobs else None)
                for i, seq in enumerate(sampled)]

    def _prompt_logits(self, sampled: list[SchedulerSequence], result) -> Callable | None:
        """Kept logits of a sampled sequence's last position, copied to the host in the model dtype on demand (only
        prompt-end checkpoints keep them); None without a forward."""
        if result is None or result.logits is None:
            return None
        logits = result.logits
        rows: dict[int, int] = {}  # built on the first call (only steps that keep prompt-end logits make one)
        dtype = getattr(torch, self.model_config.dtype)

        def prompt_logits(seq: SchedulerSequence) -> torch.Tensor | None:
            if not rows:
                rows.update((s.seq_id, i) for i, s in enumerate(sampled))
            row = rows.get(seq.seq_id)
            return None if row is None else logits[row].to('cpu', dtype)
        return prompt_logits

    def _fail_everything(self, error: str) -> list[EngineOutput]:
        """The engine stopped for good: fail every waiting and running request with `error`."""
        failed = [*self.scheduler.waiting, *self.scheduler.running]
        return self._deliver_all([self._fail(seq, f'the engine has stopped: {error}') for seq in failed])

    def _copy(self, plan: ReplyPlan) -> bool:
        """Queue the reply checkpoints' save copies; False when they failed (their checkpoints are dropped)."""
        if not plan.has_copies:
            return True
        try:
            self.agent.copy_only(self.inputs_maker.make_cache_inputs(plan))
            return True
        except Exception as exc:
            logger.exception('reply checkpoint copies failed')
            if isinstance(exc, TensorParallelFailure):
                self._fatal = str(exc)
            return False

    def _sample_logits_hits(self, hits, rejected: list[tuple[SchedulerSequence, str]]) -> list[SampledToken]:
        """First tokens of identical prompts, sampled from the logits kept with their prompt-end checkpoint. Rows
        whose sampling inputs cannot be built go to `rejected`."""
        if not hits:
            return []
        sampling, errors = make_sampling_inputs([seq for seq, _ in hits], self._generators)
        rejected += [(hits[i][0], error) for i, error in errors.items()]
        hits = [hit for i, hit in enumerate(hits) if i not in errors]
        if not hits:
            return []
        seqs = [seq for seq, _ in hits]
        logits = torch.stack([logits.to(torch.float32) for _, logits in hits])
        result = self.agent.sample(logits, sampling)
        return [SampledToken(seq, result.next_token_ids[i], result.logprobs[i] if result.logprobs else None)
                for i, seq in enumerate(seqs)]

    def _forward_collecting(self, inputs, sampling, cache_inputs, sched, collect, feed=None):
        logits, routes = self.agent.forward_logits(inputs, cache_inputs, feed) if feed is not None else \
            self.agent.forward_logits(inputs, cache_inputs)
        start = 0
        for seq, n, keep in zip(sched.seqs, sched.num_new_tokens, collect):
            if keep:
                self._collected_logits[seq.seq_id].append(logits[start:start + n])
            start += n
        result = self.agent.sample(logits[inputs.logits_indices], sampling)
        result.routed_experts = routes
        return result
