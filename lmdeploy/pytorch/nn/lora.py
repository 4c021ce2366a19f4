"""LoRA adapters on linear layers, for batches that mix adapters (and the base model) row by row.

A LoRA-capable linear (`nn.linear.Linear` / `MergedLinear`) gets a `LoRAStack` attached after its base weights
load: every resident adapter's A and B for that layer, stacked by adapter slot (slot 0 = the base model, zeros),
in the layout of `kernels/default/lora.py`. Its forward adds the delta of each token's adapter, chosen by the
forward's `ModelInputs.lora_ids`; the implementation comes from the backend (`OpType.LoRA`).

Linears do not receive the step context, so the model's forward publishes its `ModelInputs` for the duration of
the forward with `lora_step(inputs)` (a context variable, so concurrent threads and captured CUDA graphs each see
their own). Outside it, or when a forward has no adapter rows (`lora_ids is None`), LoRA layers add nothing.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
from torch import nn

from ..backends.base import OpType
from ..backends.selector import current_backend
from ..model_inputs import ModelInputs

_step_inputs: contextvars.ContextVar[ModelInputs | None] = contextvars.ContextVar('lmdeploy_lora_inputs',
                                                                                  default=None)


@contextlib.contextmanager
def lora_step(inputs: ModelInputs) -> Iterator[None]:
    """LoRA layers called inside this block read their tokens' adapter slots from `inputs`."""
    token = _step_inputs.set(inputs)
    try:
        yield
    finally:
        _step_inputs.reset(token)


class LoRAStack(nn.Module):
    """Stacked adapters of one linear: `lora_a [S, n * R, in]`, `lora_b [S, out, R]` (B pre-scaled), with `n`
    output slices of `slice_sizes` rows. Buffers, not parameters: they are not part of the base checkpoint."""

    def __init__(self, lora_a: torch.Tensor, lora_b: torch.Tensor, slice_sizes: list[int]):
        super().__init__()
        num_slots, stacked_rank, _ = lora_a.shape
        if stacked_rank % len(slice_sizes) or lora_b.shape != (num_slots, sum(slice_sizes),
                                                                stacked_rank // len(slice_sizes)):
            raise ValueError(f'LoRA stack shapes disagree: lora_a {tuple(lora_a.shape)}, lora_b '
                             f'{tuple(lora_b.shape)}, slices {slice_sizes}')
        self.register_buffer('lora_a', lora_a.contiguous(), persistent=False)
        self.register_buffer('lora_b', lora_b.contiguous(), persistent=False)
        self.slice_sizes = list(slice_sizes)
        self._impl = current_backend().build(OpType.LoRA)

    def forward(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        inputs = _step_inputs.get()
        if inputs is None or inputs.lora_ids is None:
            return out
        return self._impl(x.reshape(-1, x.size(-1)), out.view(-1, out.size(-1)), self.lora_a, self.lora_b,
                          self.slice_sizes, inputs).view(out.shape)
