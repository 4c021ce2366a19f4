"""Tiny model shapes for the tensor-parallel tests (CPU/gloo and CUDA/NCCL): head counts that make the section
split matter (gated DeltaNet n_v / n_k = 3; grouped and replicated KV heads); one rank's slice of a TP=1 state
row, written out independently of the shard plan; the prompts and the batched greedy run both modules compare."""
from __future__ import annotations

import torch

from lmdeploy.pytorch.messages import SamplingParams

HYBRID = dict(linear_num_key_heads=2, linear_num_value_heads=6, num_attention_heads=4, num_key_value_heads=2)
MODELS = {
    'qwen3_5': ('qwen3_5', HYBRID),
    'qwen3_next': ('qwen3_next', HYBRID),
    'qwen3_gqa': ('qwen3', dict(num_attention_heads=6, num_key_value_heads=2)),
    'qwen3_kv_replicated': ('qwen3', dict(num_attention_heads=4, num_key_value_heads=1)),
}
BLOCK = 16


def rank_slice_of_state(full: dict[str, torch.Tensor], text, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """The TP=1 state rows of one layer cut to rank `rank`'s heads (written out here, not taken from the plan):
    conv channels are the rank's chunk of each of the q, k, v sections; recurrent state its value heads."""
    key_dim = text.linear_num_key_heads * text.linear_key_head_dim
    value_dim = text.linear_num_value_heads * text.linear_value_head_dim
    conv = full['conv']  # [rows, conv_dim, K - 1]
    parts, start = [], 0
    for size in (key_dim, key_dim, value_dim):
        width = size // tp
        parts.append(conv[:, start + rank * width:start + (rank + 1) * width])
        start += size
    heads = text.linear_num_value_heads // tp
    recurrent = full['recurrent'][:, rank * heads:(rank + 1) * heads]
    return {'conv': torch.cat(parts, dim=1), 'recurrent': recurrent}


def random_prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1000, (n,), generator=g).tolist() for n in lengths]


def run_batched(engine, prompts: list[list[int]], max_new_tokens: int) -> list[tuple[list[int], torch.Tensor]]:
    """Greedy tokens and the float32 logits of every fed token, per prompt (all submitted at once: one batch)."""
    results = []
    for prompt in prompts:
        tokens: list[int] = []
        seq_id = engine.add_request(prompt, SamplingParams(max_new_tokens=max_new_tokens),
                                    callback=lambda out, tokens=tokens: tokens.extend(out.new_token_ids),
                                    collect_logits=True)
        results.append((seq_id, tokens))
    engine.run_until_idle()
    return [(tokens, engine.pop_collected_logits(seq_id).float()) for seq_id, tokens in results]
