"""The engine: owns the scheduler, the caches and the model agent, and runs one step at a time.

Thread model: `add_request` / `abort_request` may be called from any thread; they only queue commands. `step()`
runs on one thread (the `EngineLoop` thread, or the caller's in synchronous use): drain commands -> schedule ->
make inputs -> forward -> update -> deliver -> commit -> copy -> release. The step itself is `engine_step.py`
(`EngineStep`, a base of `Engine`); with async scheduling on (`async_scheduling.py`) a step launches its forward
before it settles the previous one, which was left in flight. This module owns construction, the request queue, the
request outputs and the statistics records.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable

import torch

from ...messages import PytorchEngineConfig
from ..config import SchedulerConfig
from ..messages import MultiModalSpan, SamplingParams, SchedulerSequence, SequenceStatus
from ..models.lora_placement import ResidentAdapter, load_lora_adapters
from ..models.model_source import resolve_model_path
from ..models.tp_geometry import check_tp_supported
from ..paging.scheduler import Scheduler
from ..paging.scheduler_output import SequenceUpdate
from .agent_setup import build_engine_agent, free_memory, load_model, make_agent_spec, rank0_device, start_workers
from .cache_sizing import make_cache_config, session_len
from .engine_stats import EngineStats, StepBatch, collect_stats
from .engine_step import EngineStep
from .inputs_maker import InputsMaker
from .request import EngineOutput, OutputCallback
from .request_checks import REPLY_ROOM, adapter_identity, check_image_spans, check_prompt, prompt_array
from .routes_recorder import RoutesRecorder
from .spec_setup import build_speculative, num_draft_tokens
from .spec_step import SpeculativeStep
from .trace import phase

logger = logging.getLogger('lmdeploy')


def resolve_dtype(engine_config: PytorchEngineConfig) -> str:
    if engine_config.dtype != 'auto':
        return engine_config.dtype
    return 'bfloat16' if engine_config.device_type == 'cuda' else 'float32'


class Engine(EngineStep):

    def __init__(self, model_path: str, engine_config: PytorchEngineConfig | None = None):
        began = time.perf_counter()
        self.engine_config = engine_config = engine_config or PytorchEngineConfig()
        if engine_config.device_type == 'cuda' and not torch.cuda.is_available():
            raise ValueError("device_type='cuda' but no CUDA device is available; use device_type='cpu'")
        # a local folder, or a hub id resolved through huggingface_hub (`ModelNotFoundError`: one line to print)
        self.model_path = resolve_model_path(model_path, engine_config.revision, engine_config.download_dir,
                                             with_weights=engine_config.load_format != 'dummy')
        check_tp_supported(self.model_path, engine_config.tp, adapters=bool(engine_config.adapters),
                           speculative=engine_config.speculative_config is not None)  # before any weight is read
        num_drafts = num_draft_tokens(engine_config)
        dtype = resolve_dtype(engine_config)
        # Tensor parallelism: ranks 1..tp-1 are worker processes (`tp_workers.py`); this process is rank 0.
        self.tp_workers = start_workers(engine_config, self.model_path, dtype)
        self.device = rank0_device(engine_config, self.tp_workers)
        try:
            self._build(engine_config, dtype, num_drafts)
        except BaseException:
            self.close()
            raise
        self._init_step_state()
        # weights, pools, FP8 tuning, the eager warm-up and the CUDA graphs: what a first request no longer pays
        self.startup_seconds = time.perf_counter() - began
        logger.info('engine start-up: %.2f s', self.startup_seconds)

    def _build(self, engine_config: PytorchEngineConfig, dtype: str, num_drafts: int) -> None:
        """Model, adapters, pools, scheduler, agent (see `agent_setup` for the order and the TP ranks' part)."""
        self.model, self.model_config = load_model(engine_config, self.model_path, self.device, dtype,
                                                   self.tp_workers)
        # name -> resident LoRA adapter (slot in every LoRA layer, prefix-cache identity); all loaded now.
        self.adapters: dict[str, ResidentAdapter] = load_lora_adapters(
            self.model, engine_config.adapters or {}, engine_config.device_type, engine_config.max_loras,
            engine_config.max_lora_rank)
        self.cache_config = make_cache_config(self.model_config, engine_config,
                                              free_memory(engine_config, self.device, self.tp_workers))
        self.scheduler_config = SchedulerConfig(
            max_batch_size=engine_config.max_batch_size, max_prefill_token_num=engine_config.max_prefill_token_num,
            session_len=session_len(self.model_config, self.cache_config, engine_config.session_len))
        self.scheduler = Scheduler(self.scheduler_config, self.cache_config, needs_state=self.model_config.is_hybrid,
                                   num_draft_tokens=num_drafts)
        self.routes = RoutesRecorder(self.model_config, engine_config.enable_return_routed_experts,
                                     keep_in_cache=engine_config.enable_prefix_caching)
        agent_spec = make_agent_spec(engine_config, self.cache_config, self.model_config, self.session_len,
                                     has_lora=bool(self.adapters))
        self.wakeup = threading.Event()
        # the largest forward is a prefill chunk or a decode batch
        self.cache_engine, self.agent = build_engine_agent(
            self.model, self.model_config, agent_spec, self.device, self.tp_workers, on_failure=self.wakeup.set,
            max_tokens=max(engine_config.max_prefill_token_num, engine_config.max_batch_size))
        self.inputs_maker = InputsMaker(self.scheduler.block_manager, self.cache_config.block_size,
                                        self.cache_config.kernel_block_size,
                                        lora_slots={a.identity: a.slot for a in self.adapters.values()})
        self.speculative: SpeculativeStep | None = build_speculative(self.agent, self.inputs_maker, num_drafts,
                                                                     self.session_len)
        logger.info('KV pool: %d blocks of %d tokens (%.1f MiB); state pool: %d rows (%.1f MiB)',
                    self.cache_config.num_blocks, self.cache_config.block_size,
                    self.cache_engine.kv_pool_bytes / 2**20, self.cache_config.num_state_slots,
                    self.cache_engine.state_pool_bytes / 2**20)

    def _init_step_state(self) -> None:
        self._lock = threading.Lock()
        # Held for a whole step, so a check from another thread (`check_integrity` in tests) runs between steps.
        self._step_lock = threading.RLock()
        # Statistics: one frozen record per step (`stats_snapshot`); `_published` guards the swap and step count.
        self._published = threading.Condition()
        self._steps_begun = 0
        self._stepping_thread: int | None = None
        self._step_listeners: list[Callable[[EngineStats], None]] = []
        # (request id, command): commands run on the engine thread at the start of a step.
        self._commands: list[tuple[int, Callable[[], list[EngineOutput]]]] = []
        self._seqs: dict[int, tuple[SchedulerSequence, OutputCallback | None]] = {}
        self._generators: dict[int, torch.Generator] = {}
        self._collected_logits: dict[int, list[torch.Tensor]] = {}
        self._ids = itertools.count(1)
        self._fatal: str | None = None
        self.last_step_idle = False
        self._init_async_state()
        self._batch = StepBatch()  # the running step's forward (its stats record's `batch`)
        self._snapshot = self._make_stats(0)

    def close(self) -> None:
        """Stop and join the tensor-parallel workers (nothing to do at tp=1); idempotent."""
        workers, self.tp_workers = getattr(self, 'tp_workers', None), None
        if workers is not None:
            workers.close()

    @property
    def fatal_error(self) -> str | None:
        """Why the engine stopped for good (a tensor-parallel rank failed), or None while it serves."""
        if self._fatal is None and self.tp_workers is not None and self.tp_workers.error is not None:
            self._fatal = self.tp_workers.error
        return self._fatal

    @property
    def session_len(self) -> int:
        return self.scheduler_config.session_len

    # ---- requests ---------------------------------------------------------------------------------------------
    def validate_prompt(self, token_ids: list[int]) -> None:
        """Raise `ValueError` for a prompt the engine cannot serve; called before any work starts."""
        check_prompt(token_ids, self.model_config.vocab_size, self.session_len)

    def adapter_identity(self, adapter_name: str | None) -> str | None:
        """The prefix-cache identity of a resident adapter (None: the base model); `UnknownAdapterError` (a
        `ValueError`) for an unknown name."""
        return adapter_identity(self.adapters, adapter_name)

    def validate_mm_spans(self, token_ids: list[int], mm_spans: tuple[MultiModalSpan, ...]) -> None:
        """Raise `ValueError` for image spans the model cannot take (see `request_checks.check_image_spans`)."""
        check_image_spans(self.model, token_ids, mm_spans, self.model_config.image_token_id)

    def add_request(self, token_ids: list[int], sampling: SamplingParams, callback: OutputCallback | None = None,
                    collect_logits: bool = False, adapter_name: str | None = None,
                    mm_spans: tuple[MultiModalSpan, ...] = ()) -> int:
        """Queue a request; returns its id. Raises `ValueError` for invalid input (nothing is queued then): the
        prompt, every sampling parameter against the ranges the sampling kernels accept, an unknown adapter, and
        image spans (`mm_spans`: the prompt's images, placeholder ranges with pixels, grid and content hash)."""
        if self.fatal_error is not None:
            raise RuntimeError(f'the engine has stopped: {self.fatal_error}')
        with phase('add_request'):
            token_ids = list(token_ids)
            identity = self.adapter_identity(adapter_name)
            self.validate_sampling(sampling)
            # validate_prompt's checks; the array keeps room for the reply's first tokens (no copy of a long prompt
            # on its first appends)
            ids = prompt_array(token_ids, self.model_config.vocab_size, self.session_len,
                               room=min(sampling.max_new_tokens, len(token_ids), REPLY_ROOM))
            mm_spans = tuple(mm_spans)
            self.validate_mm_spans(token_ids, mm_spans)
            seq = SchedulerSequence(seq_id=next(self._ids), token_ids=token_ids, num_prompt_tokens=len(token_ids),
                                    sampling=sampling, adapter_name=identity, mm_spans=mm_spans)
            self.routes.attach(seq)
            seq.adopt_token_array(ids)  # the one conversion of the prompt to int64 (the check's), in this thread

        def command() -> list[EngineOutput]:
            self._seqs[seq.seq_id] = (seq, callback)
            if collect_logits:
                self._collected_logits[seq.seq_id] = []
            if sampling.random_seed is not None and not sampling.is_greedy:
                self._generators[seq.seq_id] = torch.Generator(self.device).manual_seed(sampling.random_seed)
            if sampling.max_new_tokens == 0:
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, 'length'
                return [self._finish_output(seq)]
            self.scheduler.add(seq)
            return []

        self._push(seq.seq_id, command)
        return seq.seq_id

    def validate_sampling(self, sampling: SamplingParams) -> None:
        """Raise `ValueError` for sampling parameters outside what the kernels take, or asking for what this engine
        does not do (routed experts with the engine flag off)."""
        sampling.validate(self.model_config.vocab_size)
        self.routes.validate(sampling)

    def abort_request(self, seq_id: int) -> None:
        def command() -> list[EngineOutput]:
            entry = self._seqs.get(seq_id)
            if entry is None or entry[0].is_finished:
                return []
            self.scheduler.abort(entry[0])
            return [self._finish_output(entry[0])]
        self._push(seq_id, command)

    def _push(self, seq_id: int, command: Callable[[], list[EngineOutput]]) -> None:
        with self._lock:
            self._commands.append((seq_id, command))
        self.wakeup.set()

    def _run_command(self, seq_id: int, command: Callable[[], list[EngineOutput]]) -> list[EngineOutput]:
        """A failing command fails its own request only."""
        try:
            return command()
        except Exception as exc:
            logger.exception('request %d: command failed', seq_id)
            entry = self._seqs.get(seq_id)
            if entry is not None and not entry[0].is_finished:
                if entry[0] in self.scheduler.waiting or entry[0] in self.scheduler.running:
                    return [self._fail(entry[0], f'request failed: {exc}')]
                entry[0].status, entry[0].finish_reason = SequenceStatus.ABORTED, 'error'
                out = self._finish_output(entry[0])
                out.error = f'request failed: {exc}'
                return [out]
            return []

    @property
    def has_work(self) -> bool:
        with self._lock:
            return bool(self._commands) or self.scheduler.has_unfinished or self._inflight is not None

    # ---- one step ---------------------------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        with self._step_lock:
            with self._published:
                self._steps_begun += 1
                step = self._steps_begun
            self._stepping_thread = threading.get_ident()
            self._batch = StepBatch()
            try:
                return self._step()
            finally:
                self._stepping_thread = None
                self._publish(self._make_stats(step))

    # ---- request outputs ---------------------------------------------------------------------------------------
    def _update_output(self, update: SequenceUpdate) -> EngineOutput:
        seq, reason = update.seq, update.finish_reason
        out = EngineOutput(seq.seq_id, update.new_token_ids, finished=reason is not None, finish_reason=reason,
                           num_cached=seq.num_cached, logprobs=update.logprobs)
        if reason is not None:
            out.routed_experts = self.routes.result(seq)
        return out

    def _error_output(self, seq: SchedulerSequence, error: str) -> EngineOutput:
        """The output of a sequence the scheduler already failed."""
        out = self._finish_output(seq)
        out.error = error
        return out

    def _reject(self, seq: SchedulerSequence, error: str) -> EngineOutput:
        logger.error('request %d: %s', seq.seq_id, error)
        return self._fail(seq, error)

    def _deliver_all(self, outputs: list[EngineOutput]) -> list[EngineOutput]:
        for out in outputs:
            self._deliver(out)
        return outputs

    def _fail(self, seq: SchedulerSequence, error: str) -> EngineOutput:
        self.scheduler.finish(seq, SequenceStatus.ABORTED, 'error')
        out = self._finish_output(seq)
        out.error = error
        return out

    def _finish_output(self, seq: SchedulerSequence) -> EngineOutput:
        self._forget(seq.seq_id)
        return EngineOutput(seq.seq_id, finished=True, finish_reason=seq.finish_reason, num_cached=seq.num_cached,
                            routed_experts=self.routes.result(seq))

    def _forget(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)

    def _deliver(self, out: EngineOutput) -> None:
        entry = self._seqs.get(out.seq_id)
        if entry is None:
            return
        if out.finished:
            del self._seqs[out.seq_id]
        if entry[1] is not None:
            try:
                entry[1](out)
            except Exception:  # a consumer's failure must not cut the step short (its bookkeeping follows)
                logger.exception('output callback of request %d failed', out.seq_id)

    # ---- helpers for synchronous use and tests ----------------------------------------------------------------
    def pop_collected_logits(self, seq_id: int) -> torch.Tensor:
        """Logits [num_fed_tokens, vocab] of every token this request fed to the model (cached ones excluded)."""
        chunks = self._collected_logits.pop(seq_id)
        return torch.cat(chunks) if chunks else torch.empty(0)

    def run_until_idle(self) -> None:
        while self.has_work:
            self.step()

    def check_integrity(self) -> None:
        """Block / slot accounting check; between steps (it waits for a running step's bookkeeping, which goes on
        after the step's outputs were delivered)."""
        with self._step_lock:
            self.scheduler.check_integrity()

    # ---- statistics ---------------------------------------------------------------------------------------------
    def _make_stats(self, step: int) -> EngineStats:
        return collect_stats(step, self.scheduler, self.cache_config, self.agent.vision_cache, self.routes,
                             self.speculative.stats if self.speculative is not None else None, self._batch)

    def _publish(self, snapshot: EngineStats) -> None:
        with self._published:
            self._snapshot = snapshot
            self._published.notify_all()
        for listener in self._step_listeners:
            listener(snapshot)

    def mark_stats(self) -> None:
        """Between steps (the engine idle): count live checkpoints from here on (`live_since_mark`), for a benchmark
        that leaves its warm-up's checkpoints out of its figures."""
        with self._step_lock:
            self.scheduler.prefix_cache.mark()
            self._publish(self._make_stats(self._snapshot.step))

    def add_step_listener(self, listener: Callable[[EngineStats], None]) -> None:
        """Call `listener` with every published record, on the engine thread right after its step (keep it short)."""
        self._step_listeners.append(listener)

    @property
    def stats_snapshot(self) -> EngineStats:
        """The record of the last completed step. From another thread while a step runs, it waits for that step's
        record (a reader that has seen a step's outputs then sees its bookkeeping too); a step never waits for a
        reader. On the engine thread itself (an output callback) it is the previous step's."""
        if self._stepping_thread == threading.get_ident():
            return self._snapshot
        with self._published:
            target = self._steps_begun
            self._published.wait_for(lambda: self._snapshot.step >= target)
            return self._snapshot

    @property
    def stats(self) -> dict:
        """`stats_snapshot` as a flat dict: prefix-cache counters (zeros when prefix caching is off), plus the
        vision-encoder cache's."""
        return self.stats_snapshot.as_dict()
