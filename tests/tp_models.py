"""Tiny model shapes for the tensor-parallel tests (CPU/gloo and CUDA/NCCL): head counts that make the section
split matter (gated DeltaNet n_v / n_k = 3; grouped and replicated KV heads)."""

HYBRID = dict(linear_num_key_heads=2, linear_num_value_heads=6, num_attention_heads=4, num_key_value_heads=2)
MODELS = {
    'qwen3_5': ('qwen3_5', HYBRID),
    'qwen3_next': ('qwen3_next', HYBRID),
    'qwen3_gqa': ('qwen3', dict(num_attention_heads=6, num_key_value_heads=2)),
    'qwen3_kv_replicated': ('qwen3', dict(num_attention_heads=4, num_key_value_heads=1)),
}
BLOCK = 16
