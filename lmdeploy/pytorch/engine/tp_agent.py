"""`TPModelAgent`: rank 0's `ModelAgent` under tensor parallelism, with the same interface the engine calls.

Every call that touches the model or the pools first sends the same payload to every worker (`TPWorkers.send`),
then runs rank 0's part locally, so every rank applies the same restore copies, forward and save copies in the same
order on its own shard of the KV and state pools (identical logical ids on every rank). Only rank 0 computes
logits (its hidden states are the all-reduced, replicated ones) and samples; the sampled tokens reach the other
ranks as the next step's `input_ids`. `sample` (logits kept from an earlier forward) runs on rank 0 alone.

Failure is terminal: once a payload went out, the ranks' collective order depends on every rank finishing its
part, so any exception there (a worker that died, rank 0 itself) marks the group broken and raises
`TensorParallelFailure`; the engine then fails every request and stops (it never retries a step).
"""
from __future__ import annotations

from collections.abc import Callable

from .model_agent import ForwardOutput, ModelAgent
from .tp_workers import TensorParallelFailure, TPWorkers


class TPModelAgent:

    def __init__(self, local: ModelAgent, workers: TPWorkers):
        self.local = local
        self.workers = workers

    def __getattr__(self, name: str):  # cache_engine, vision_cache, streams, ... are rank 0's
        return getattr(self.local, name)

    def _step(self, command: tuple, run: Callable):
        self.workers.send(command)
        try:
            return run()
        except TensorParallelFailure:
            raise
        except Exception as exc:
            raise self.workers.fail_from(exc) from exc

    def forward(self, inputs, sampling, cache_inputs=None) -> ForwardOutput:
        return self._step(('run', inputs, cache_inputs), lambda: self.local.forward(inputs, sampling, cache_inputs))

    def forward_logits(self, inputs, cache_inputs=None):
        return self._step(('run', inputs, cache_inputs), lambda: self.local.forward_logits(inputs, cache_inputs))

    def copy_only(self, cache_inputs) -> None:
        self._step(('copy', cache_inputs), lambda: self.local.copy_only(cache_inputs))

    def capture_cuda_graphs(self) -> None:
        """The warm start on every rank in step (the eager warm-up runs collectives even without graphs)."""
        if self.local.device.type == 'cuda':
            self._step(('capture',), self.local.capture_cuda_graphs)

    def sample(self, logits, sampling) -> ForwardOutput:
        return self.local.sample(logits, sampling)

    def rank_state_caches(self) -> list[list[dict]]:
        """Each rank's state pool views, rank 0 first (tests compare a rank's rows with the TP=1 head slice)."""
        return [self.local.cache_engine.state_caches, *self.workers.query_state()]
