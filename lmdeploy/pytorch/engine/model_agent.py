"""Runs one forward on the device: copies inputs over, runs the model, samples.

Owns the model and the device side of a step. Order inside `forward`: inputs to device -> model forward ->
logits of the sampled rows -> sampling. It never touches scheduler state.
"""
from __future__ import annotations

import torch
from torch import nn

from ..backends.base import Backend, OpType
from ..model_inputs import ModelInputs, SamplingInputs, StepContext
from .cache_engine import CacheEngine


class ForwardOutput:
    __slots__ = ('next_token_ids', 'logprobs')

    def __init__(self, next_token_ids: list[int], logprobs: list[dict[int, float]] | None):
        self.next_token_ids = next_token_ids
        self.logprobs = logprobs


class ModelAgent:

    def __init__(self, model: nn.Module, cache_engine: CacheEngine, backend: Backend, device: torch.device):
        self.model = model
        self.cache_engine = cache_engine
        self.device = device
        self._sample = backend.build(OpType.Sampling)

    def _context(self, inputs: ModelInputs) -> StepContext:
        return StepContext(inputs=inputs, kv_caches=self.cache_engine.kv_caches,
                           state_caches=self.cache_engine.state_caches,
                           kernel_block_size=self.cache_engine.cache_config.kernel_block_size)

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs, sampling: SamplingInputs) -> ForwardOutput:
        inputs = inputs.to(self.device)
        sampling = sampling.to(self.device)
        hidden = self.model(self._context(inputs))
        if inputs.logits_indices.numel() == 0:
            return ForwardOutput([], None)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        next_ids, logprobs = self._sample(logits, sampling)
        return ForwardOutput(next_ids.tolist(), logprobs)

    @torch.inference_mode()
    def forward_logits(self, inputs: ModelInputs) -> torch.Tensor:
        """Logits of every fed token (teacher forcing, for tests and scoring); caches are updated as usual."""
        inputs = inputs.to(self.device)
        hidden = self.model(self._context(inputs))
        return self.model.compute_logits(hidden)
