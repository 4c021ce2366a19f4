"""Routed-experts reference for tests: tiny MoE checkpoints and transformers' router logits.

transformers' forward with `output_router_logits=True` returns `[tokens, num_experts]` router logits per MoE layer;
their top-k is the set of experts a token was routed to. Sets are compared per token and layer, except where the
k-th and (k+1)-th logits are a near-tie (float32 rounding may then pick either expert). `Finished` collects one
engine request's tokens and its final output (which carries the routes).
"""
from __future__ import annotations

import numpy as np
import torch
import transformers

from lmdeploy import demo_model

LIN, FULL = 'linear_attention', 'full_attention'
TIE = 1e-4  # router logits closer than this at the top-k boundary are a near-tie: not compared


class Finished:
    """Collects one request's tokens and its finished output (an engine output callback)."""

    def __init__(self):
        self.tokens: list[int] = []
        self.final = None

    def __call__(self, out):
        self.tokens += out.new_token_ids
        if out.finished:
            self.final = out


def prompt(length: int, seed: int, vocab: int = 1000) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def build_qwen3_next(tiny_model_factory) -> tuple[str, torch.nn.Module]:
    """Qwen3-Next with MoE layers 0, 1, 3 (4 experts, top-2) and a dense MLP in layer 2."""
    path = tiny_model_factory('qwen3_next', num_hidden_layers=4, layer_types=[LIN, FULL, LIN, LIN],
                              mlp_only_layers=[2])
    return path, transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def build_qwen3_5_moe(path: str) -> tuple[str, torch.nn.Module]:
    """Qwen3.5-MoE, every layer MoE (8 experts, top-3), saved to `path`."""
    config = transformers.Qwen3_5MoeTextConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=3, layer_types=[LIN, FULL, LIN], num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8,
        num_experts_per_tok=3, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen3_5MoeForCausalLM(config).eval()
    demo_model._perturb_(model)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    return path, model


@torch.no_grad()
def reference_routes(model: torch.nn.Module, token_ids: list[int]) -> list[torch.Tensor]:
    """Router logits [T, E] of every MoE layer, in layer order."""
    out = model(input_ids=torch.tensor([token_ids]), output_router_logits=True, use_cache=False)
    return [logits.reshape(len(token_ids), -1).float() for logits in out.router_logits]


def assert_routes_match(routes: np.ndarray, ref_logits: list[torch.Tensor], top_k: int) -> int:
    """`routes` [T, L, k] against the top-k of each layer's router logits; returns the number of compared sets."""
    assert routes.dtype == np.uint16 and routes.shape == (ref_logits[0].size(0), len(ref_logits), top_k)
    compared = 0
    for layer, logits in enumerate(ref_logits):
        values, ids = logits.topk(top_k + 1, dim=-1)
        for t in range(logits.size(0)):
            if values[t, top_k - 1] - values[t, top_k] < TIE:
                continue
            assert set(routes[t, layer].tolist()) == set(ids[t, :top_k].tolist()), f'token {t}, MoE layer {layer}'
            compared += 1
    return compared
