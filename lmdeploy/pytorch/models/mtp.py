"""The multi-token-prediction (MTP) head of Qwen3.5 and Qwen3-Next checkpoints (`mtp.*` weights).

One draft step from the target's hidden state `h_t` (its last decoder layer's output, *before* the final norm) and
the next token `x_{t+1}`:

    h' = fc(cat[pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)])      fc: [H, 2H], no bias
    h' = layers[step % n](h')   one full-attention decoder layer (q/k norm, output gate, MLP or MoE like layer 0's)
    logits = lm_head(norm(h'))  embedding and lm_head shared with the target

Row t of a head forward sits at position t (the position of `h_t`) and predicts token t + 2. All norms are
zero-centred RMSNorm. The head's attention layers keep KV in the target's KV pool, as extra pool layers after the
target's (`ModelConfig.num_mtp_layers`; cache index `num_attn_layers + i`), so they share its paged geometry and
logical block ids: every copy, restore and free of a block covers the head's KV too.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..model_inputs import StepContext
from ..nn.linear import Embedding, Linear
from ..nn.norm import RMSNorm
from ..nn.rotary import RotaryEmbedding

MTP_PREFIX = 'mtp.'


def mtp_num_layers_of(cfg) -> int:
    """MTP decoder layers a text config declares: `mtp_num_hidden_layers` (Qwen3.5) or `num_nextn_predict_layers`
    (Qwen3-Next); 0 when neither is set."""
    for key in ('mtp_num_hidden_layers', 'num_nextn_predict_layers'):
        value = getattr(cfg, key, None)
        if value:
            return int(value)
    return 0


class MTPHead(nn.Module):
    """`fc`, `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `norm` and `layers` (checkpoint names under `mtp.`).

    `make_layer(i, cache_index)` builds MTP decoder layer i, a full-attention `HybridDecoderLayer` whose attention
    uses KV pool layer `cache_index`."""

    def __init__(self, cfg, num_layers: int, first_cache_index: int,
                 make_layer: Callable[[int, int], nn.Module]):
        super().__init__()
        if num_layers <= 0:
            raise ValueError(f'an MTP head needs at least one layer, got {num_layers}')
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = Linear(2 * hidden, hidden)
        self.pre_fc_norm_embedding = RMSNorm(hidden, eps, zero_centered=True)
        self.pre_fc_norm_hidden = RMSNorm(hidden, eps, zero_centered=True)
        self.norm = RMSNorm(hidden, eps, zero_centered=True)
        self.layers = nn.ModuleList(make_layer(i, first_cache_index + i) for i in range(num_layers))

    def forward(self, embed_tokens: Embedding, rotary: RotaryEmbedding, prev_hidden: torch.Tensor,
                ctx: StepContext, step: int = 0) -> torch.Tensor:
        """Normed draft hidden states [T, H] for `ctx.inputs.input_ids` (the tokens x_{t+1}) and `prev_hidden`
        [T, H] (the pre-norm hidden h_t each row follows); `step` picks the layer (draft k uses layer k % n)."""
        inputs = ctx.inputs
        x = torch.cat([self.pre_fc_norm_embedding(embed_tokens(inputs.input_ids)),
                       self.pre_fc_norm_hidden(prev_hidden.to(self.fc.weight.dtype))], dim=-1)
        x = self.fc(x)
        positions = inputs.position_ids if inputs.mrope_position_ids is None else inputs.mrope_position_ids
        x = self.layers[step % len(self.layers)](x, rotary, rotary.cos_sin(positions), ctx)
        return self.norm(x)
