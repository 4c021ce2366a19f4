"""Model shapes the benchmarks build with random weights, as transformers config keyword arguments, defined once.

`QWEN3_NEXT_3B` is the Qwen3-Next-shaped checkpoint of `bench_vs_transformers.py` and `bench_host_per_layer.py`
(the latter with a small vocabulary); `SMOKE_WIDTHS` are the tiny widths every `--smoke` run (CPU, float32) puts
over a shape: they check a script's logic, their numbers mean nothing.
"""
from __future__ import annotations

LINEAR, FULL = 'linear_attention', 'full_attention'

# Qwen3-Next-shaped, ~3.46B parameters (6.9 GB in bf16): 12 layers, 3 gated-DeltaNet : 1 full attention,
# 64 experts top-10.
QWEN3_NEXT_3B = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=12,
    layer_types=[LINEAR, LINEAR, LINEAR, FULL] * 3, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, num_experts=64, num_experts_per_tok=10, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
    max_position_embeddings=32768, initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters={'rope_type': 'default', 'rope_theta': 10000000.0, 'partial_rotary_factor': 0.25},
    bos_token_id=151643, eos_token_id=151645, pad_token_id=151643,
)
# A vocabulary of 1,024 with its special ids (random prompts; no tokenizer).
SMALL_VOCAB = dict(vocab_size=1024, bos_token_id=1, eos_token_id=2, pad_token_id=1)

SMOKE_WIDTHS = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                    num_hidden_layers=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                    num_experts_per_tok=2)
# SMOKE_WIDTHS for a hybrid with experts: four layers 3:1, four experts.
SMOKE_HYBRID = dict(SMOKE_WIDTHS, layer_types=[LINEAR, LINEAR, LINEAR, FULL], num_experts=4)
