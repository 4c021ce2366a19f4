"""`cache_sizing.make_cache_config` and `session_len` without a model: the pools' geometry from the model's shapes, the
user's config and the free memory (the row / block arithmetic itself: test_cache_sizing.py)."""
from __future__ import annotations

import dataclasses
import logging

import pytest

from lmdeploy import PrefixCacheConfig, PytorchEngineConfig
from lmdeploy.pytorch.config import ModelConfig, StateSpec
from lmdeploy.pytorch.engine import cache_sizing

# 2 attention layers of 2 KV heads x 8 dims in float32: a 16-token block is 2 layers x (K + V) x 16 x 2 x 8 x 4 B.
BLOCK_BYTES = 2 * 2 * 16 * 2 * 8 * 4


def model(hybrid: bool, max_positions: int = 4096) -> ModelConfig:
    specs = (StateSpec('conv', (4, 3), 'float32'), StateSpec('ssm', (2, 4, 4), 'float32')) if hybrid else ()
    return ModelConfig(architecture='t', hidden_size=16, num_layers=4, vocab_size=32, attn_layer_ids=(1, 3),
                       num_kv_heads=2, head_dim=8, dtype='float32', max_position_embeddings=max_positions,
                       recurrent_layer_ids=(0, 2) if hybrid else (), state_specs=specs)


def engine_config(**kw) -> PytorchEngineConfig:
    return PytorchEngineConfig(device_type='cpu', block_size=16, max_batch_size=4, **kw)


def test_cache_config_follows_the_plan_and_carries_the_resolved_knobs():
    cfg = engine_config(cache_max_entry_count=0.5, enable_prefix_caching=True,
                        prefix_cache=PrefixCacheConfig(state_budget=5, prefill_state_interval=20))
    cache = cache_sizing.make_cache_config(model(hybrid=True), cfg, free_bytes=1 << 20)
    row = cache.state_row_bytes
    plan = cache_sizing.plan_cache(free_bytes=1 << 20, block_bytes=BLOCK_BYTES, row_bytes=row, is_hybrid=True,
                                   max_batch_size=4, cache_max_entry_count=0.5, state_budget=5,
                                   state_ratio=0.2, prefix_caching=True)
    assert cache.kv_block_bytes == BLOCK_BYTES and row >= 2 * (48 + 128)
    assert (cache.num_blocks, cache.num_state_slots) == (plan.num_blocks, plan.num_state_slots) == (
        plan.num_blocks, 1 + 4 + 1 + 5)
    assert cache.prefix_cache == dataclasses.replace(cfg.prefix_cache, prefill_state_interval=32)


def test_caching_off_carries_no_knobs_and_a_fixed_block_count_reads_no_memory():
    cache = cache_sizing.make_cache_config(model(hybrid=False), engine_config(num_gpu_blocks=7), free_bytes=None)
    assert (cache.num_blocks, cache.num_state_slots, cache.prefix_cache) == (7, 0, None)
    assert not cache.enable_prefix_caching


def test_too_little_memory_for_one_block_is_an_error():
    with pytest.raises(ValueError, match='single KV block'):
        cache_sizing.make_cache_config(model(hybrid=False), engine_config(), free_bytes=BLOCK_BYTES)


def test_session_length_is_bounded_by_kv_capacity_and_positions(caplog):
    cache = cache_sizing.make_cache_config(model(hybrid=False), engine_config(num_gpu_blocks=10), free_bytes=None)
    assert cache_sizing.session_len(model(hybrid=False, max_positions=100), cache, None) == 100
    assert cache_sizing.session_len(model(hybrid=False), cache, None) == 160
    assert cache_sizing.session_len(model(hybrid=False), cache, 50) == 50
    with caplog.at_level(logging.WARNING, logger='lmdeploy'):
        assert cache_sizing.session_len(model(hybrid=False), cache, 1000) == 160
    assert 'exceeds the KV capacity' in caplog.text
