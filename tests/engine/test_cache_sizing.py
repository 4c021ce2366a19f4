"""Pool sizing without a model (`engine/cache_sizing.py`), and what the engine logs and reports about it."""
from __future__ import annotations

import logging

import pytest

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.cache_sizing import plan_cache
from lmdeploy.pytorch.engine.engine import Engine

MiB = 1 << 20
SIZES = dict(block_bytes=MiB, row_bytes=10 * MiB, max_batch_size=4, cache_max_entry_count=0.5)


def test_checkpoint_rows_are_a_share_of_the_cache_memory_like_the_kv_pool():
    # 1000 MiB free: 6 runtime rows (60 MiB) first, then half of the rest is cache: 470 MiB. A fifth of it (94 MiB)
    # buys 9 rows of 10 MiB; the KV pool gets the remaining 380 MiB.
    plan = plan_cache(free_bytes=1000 * MiB, is_hybrid=True, state_ratio=0.2, prefix_caching=True, **SIZES)
    assert plan == (380, 6 + 9, 9)
    # Without prefix caching (or on a dense model) checkpoints need no rows: the KV pool takes it all.
    assert plan_cache(free_bytes=1000 * MiB, is_hybrid=True, state_ratio=0.2, **SIZES) == (470, 6, 0)
    assert plan_cache(free_bytes=1000 * MiB, is_hybrid=False, state_ratio=0.2, prefix_caching=True,
                      **SIZES) == (500, 0, 0)


def test_an_explicit_budget_or_a_fixed_kv_pool_overrides_the_ratio():
    # A budget is exact: 3 rows, and the KV pool is what the cache share leaves after all 9 rows.
    assert plan_cache(free_bytes=1000 * MiB, is_hybrid=True, state_budget=3, state_ratio=0.2, prefix_caching=True,
                      **SIZES) == ((1000 - 90) // 2, 9, 3)
    # A fixed KV pool (num_gpu_blocks) is sized by hand: checkpoint rows only from the budget.
    assert plan_cache(free_bytes=0, is_hybrid=True, num_gpu_blocks=64, state_ratio=0.2, prefix_caching=True,
                      **SIZES) == (64, 6, 0)


@pytest.mark.parametrize('arch', ['qwen3_5', 'qwen3'])
def test_engine_logs_and_reports_how_many_checkpoints_fit(tiny_model_factory, caplog, arch):
    config = PytorchEngineConfig(device_type='cpu', block_size=16, max_batch_size=4, enable_prefix_caching=True,
                                 cache_max_entry_count=0.05, prefix_cache_state_ratio=0.1)
    with caplog.at_level(logging.INFO, logger='lmdeploy'):
        engine = Engine(tiny_model_factory(arch), config)
    cfg, stats = engine.cache_config, engine.stats
    if arch == 'qwen3':
        assert cfg.num_state_slots == 0 and stats['checkpoint_rows'] == 0
        return
    rows = cfg.prefix_cache.state_budget
    assert rows > 0 and cfg.num_state_slots == 6 + rows
    # Rows cost about a tenth of the cache share (rounded down to whole rows).
    share = rows * cfg.state_row_bytes / (rows * cfg.state_row_bytes + cfg.num_blocks * cfg.kv_block_bytes)
    assert 0.09 < share <= 0.1
    assert f'prefix cache: {rows} state rows for checkpoints' in caplog.text
    assert stats['checkpoint_rows'] == rows and stats['checkpoint_capacity'] == cfg.num_state_slots - 2
