"""Memory sizing (`engine/memory_sizing.py`) without a model: state rows, KV blocks from free memory, session length."""
from __future__ import annotations

import logging

import pytest

from lmdeploy import PrefixCacheConfig, PytorchEngineConfig
from lmdeploy.pytorch.config import ModelConfig, StateSpec
from lmdeploy.pytorch.engine import memory_sizing

# 2 attention layers of 2 KV heads x 8 dims in float32: a 16-token block is 2 layers x (K + V) x 16 x 2 x 8 x 4 B.
BLOCK_BYTES = 2 * 2 * 16 * 2 * 8 * 4
# 2 recurrent layers, each a float32 conv state [4, 3] (48 B) and a float32 state [2, 4, 4] (128 B), each piece
# aligned to the pool's alignment inside the row.


def model(hybrid: bool, max_positions: int = 4096) -> ModelConfig:
    specs = (StateSpec('conv', (4, 3), 'float32'), StateSpec('ssm', (2, 4, 4), 'float32')) if hybrid else ()
    return ModelConfig(architecture='t', hidden_size=16, num_layers=4, vocab_size=32, attn_layer_ids=(1, 3),
                       num_kv_heads=2, head_dim=8, dtype='float32', max_position_embeddings=max_positions,
                       recurrent_layer_ids=(0, 2) if hybrid else (), state_specs=specs)


def engine_config(**kw) -> PytorchEngineConfig:
    return PytorchEngineConfig(device_type='cpu', block_size=16, max_batch_size=4, **kw)


def test_state_rows_serve_the_batch_a_spare_the_dummy_and_the_checkpoint_budget():
    cfg = engine_config(prefix_cache=PrefixCacheConfig(state_budget=5))
    assert memory_sizing.num_state_slots(model(hybrid=True), cfg) == 1 + 4 + 1 + 5
    assert memory_sizing.num_state_slots(model(hybrid=False), cfg) == 0


def test_blocks_take_the_entry_fraction_of_the_memory_left_after_the_state_pool():
    cfg = engine_config(cache_max_entry_count=0.5)
    cache = memory_sizing.make_cache_config(model(hybrid=True), cfg, free_bytes=1 << 20)
    row = cache.state_row_bytes
    assert cache.kv_block_bytes == BLOCK_BYTES and row >= 2 * (48 + 128)
    assert cache.num_state_slots == 6
    assert cache.num_blocks == int(((1 << 20) - 6 * row) * 0.5) // BLOCK_BYTES
    assert cache.prefix_cache is None


def test_a_fixed_block_count_needs_no_memory_reading_and_resolves_the_prefix_cache():
    cfg = engine_config(num_gpu_blocks=7, enable_prefix_caching=True,
                        prefix_cache=PrefixCacheConfig(prefill_state_interval=20))
    cache = memory_sizing.make_cache_config(model(hybrid=False), cfg, free_bytes=None)
    assert (cache.num_blocks, cache.num_state_slots) == (7, 0)
    assert cache.prefix_cache == PrefixCacheConfig(prefill_state_interval=32)


def test_too_little_memory_for_one_block_is_an_error():
    with pytest.raises(ValueError, match='single KV block'):
        memory_sizing.make_cache_config(model(hybrid=False), engine_config(), free_bytes=BLOCK_BYTES)


def test_session_length_is_bounded_by_kv_capacity_and_positions(caplog):
    cache = memory_sizing.make_cache_config(model(hybrid=False, max_positions=100), engine_config(num_gpu_blocks=10),
                                            free_bytes=None)
    assert memory_sizing.session_len(model(hybrid=False, max_positions=100), cache, None) == 100
    assert memory_sizing.session_len(model(hybrid=False, max_positions=4096), cache, None) == 160
    assert memory_sizing.session_len(model(hybrid=False), cache, 50) == 50
    with caplog.at_level(logging.WARNING, logger='lmdeploy'):
        assert memory_sizing.session_len(model(hybrid=False), cache, 1000) == 160
    assert 'exceeds the KV capacity' in caplog.text
