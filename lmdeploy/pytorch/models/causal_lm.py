"""The causal-LM wrapper every model here shares: a decoder `self.model` (StepContext -> hidden states), an
`lm_head` unless the embeddings are tied, the LoRA step around each forward, float32 logits, and weight loading
through `weight_loading.load_weights` with the class's `stacked_params` and its name / tensor hooks."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..model_inputs import StepContext
from ..nn.linear import Linear
from ..nn.lora import lora_step
from .weight_loading import StackedMapping, load_weights


class CausalLM(nn.Module):
    """Subclasses build `self.model` and call `init_lm_head`; they override `rename_weight` / `convert_weight` where
    their checkpoints name or lay out tensors differently."""

    # checkpoint q/k/v and gate/up projections -> the fused qkv_proj / gate_up_proj rows, in this order
    stacked_params: StackedMapping = [
        ('qkv_proj', 'q_proj', 0), ('qkv_proj', 'k_proj', 1), ('qkv_proj', 'v_proj', 2),
        ('gate_up_proj', 'gate_proj', 0), ('gate_up_proj', 'up_proj', 1)]
    model: nn.Module

    def init_lm_head(self, hidden_size: int, vocab_size: int, tie_word_embeddings: bool) -> None:
        """A tied model has no `lm_head`: its logits use the embedding matrix."""
        self.tie_word_embeddings = tie_word_embeddings
        self.lm_head = None if tie_word_embeddings else Linear(hidden_size, vocab_size)

    def forward(self, ctx: StepContext) -> torch.Tensor:
        with lora_step(ctx.inputs):
            return self.model(ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight).float()

    def rename_weight(self, name: str) -> str | None:
        """Checkpoint name -> model name, or None to drop it (a tied `lm_head` duplicates the embedding)."""
        if self.tie_word_embeddings and name.startswith('lm_head.'):
            return None
        return name

    def convert_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Hook for checkpoint tensors whose layout differs from ours (identity here)."""
        return tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], **fp8) -> None:
        """All checkpoint tensors; `fp8` as `weight_loading.load_weights` takes it."""
        load_weights(self, weights, self.stacked_params, self.rename_weight, self.convert_weight, **fp8)
