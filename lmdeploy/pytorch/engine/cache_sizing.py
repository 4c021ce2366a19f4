"""How many KV blocks and state rows the cache pools get, and the session length they allow: pure functions of byte
sizes, the model's geometry and the config, tested without a model.

Owns no memory; runs once in `Engine.__init__`, after the weights are loaded (`free_memory_bytes` then reads what
they left) and before `CacheEngine` allocates what `make_cache_config` returns.

The state pool of a hybrid model holds row 0 (a dummy), one runtime row per running sequence, one spare row for
the batch being scheduled (with speculative decoding, K spare rows per running sequence too: the state after each
draft position), and `num_checkpoint_rows` rows only checkpoints use (idle runtime rows serve them too).
With prefix caching the checkpoint rows are sized like the KV pool, as a share of the cache memory:

    cache = (free - runtime rows) * cache_max_entry_count
    checkpoint rows = cache * prefix_cache_state_ratio // row bytes
    KV blocks = (cache - checkpoint rows * row bytes) // block bytes

unless the config fixes them: `prefix_cache_state_budget > 0` is an exact number of checkpoint rows, and a fixed
`num_gpu_blocks` (no memory sizing) keeps only that budget.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import NamedTuple

import torch

from ...messages import PytorchEngineConfig
from ..config import CacheConfig, ModelConfig
from .cache_engine import kv_block_bytes, state_row_layout

logger = logging.getLogger('lmdeploy')
# The cache budget on CPU: a quarter of physical memory, at most this much.
CPU_CACHE_BUDGET = 1 << 30


class CachePlan(NamedTuple):
    num_blocks: int           # KV blocks of block_size tokens
    num_state_slots: int      # state-pool rows in all (0 for dense models)
    num_checkpoint_rows: int  # of which only checkpoints use


def plan_cache(*, free_bytes: int, block_bytes: int, row_bytes: int, is_hybrid: bool, max_batch_size: int,
               cache_max_entry_count: float, num_gpu_blocks: int = 0, state_budget: int = 0,
               state_ratio: float = 0.0, prefix_caching: bool = False, draft_rows_per_seq: int = 0) -> CachePlan:
    """Pool sizes for `free_bytes` of device memory (see the module docstring)."""
    runtime_rows = 1 + max_batch_size * (1 + draft_rows_per_seq) + 1 if is_hybrid else 0
    rows = state_budget if is_hybrid else 0
    if num_gpu_blocks:
        return CachePlan(num_gpu_blocks, runtime_rows + rows if is_hybrid else 0, rows)
    if rows:
        cache = int((free_bytes - (runtime_rows + rows) * row_bytes) * cache_max_entry_count)
        return CachePlan(max(cache, 0) // block_bytes, runtime_rows + rows, rows)
    cache = max(int((free_bytes - runtime_rows * row_bytes) * cache_max_entry_count), 0)
    if is_hybrid and prefix_caching and state_ratio > 0:
        rows = int(cache * state_ratio) // row_bytes
    return CachePlan((cache - rows * row_bytes) // block_bytes, runtime_rows + rows, rows)


def free_memory_bytes(device: torch.device) -> int:
    """Device memory the cache pools may use (after weights); on CPU a fixed budget."""
    if device.type == 'cuda':
        free, _ = torch.cuda.mem_get_info(device)
        return free
    total = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
    return min(total // 4, CPU_CACHE_BUDGET)


def make_cache_config(model_config: ModelConfig, engine_config: PytorchEngineConfig, free_bytes: int | None
                      ) -> CacheConfig:
    """The pools' geometry (`plan_cache`); `free_bytes` is needed only without a fixed `num_gpu_blocks`. The prefix
    cache's knobs come resolved to the block size, `state_budget` being the checkpoint rows planned. `ValueError`
    when not even one KV block fits."""
    cfg, knobs = engine_config, engine_config.prefix_cache
    _, row_bytes = state_row_layout(model_config)
    block_bytes = kv_block_bytes(model_config, cfg.block_size, getattr(torch, model_config.dtype))
    plan = plan_cache(free_bytes=free_bytes or 0, block_bytes=block_bytes, row_bytes=row_bytes,
                      is_hybrid=model_config.is_hybrid, max_batch_size=cfg.max_batch_size,
                      cache_max_entry_count=cfg.cache_max_entry_count, num_gpu_blocks=cfg.num_gpu_blocks,
                      state_budget=knobs.state_budget, state_ratio=knobs.state_ratio,
                      prefix_caching=cfg.enable_prefix_caching,
                      draft_rows_per_seq=cfg.speculative_config.num_speculative_tokens
                      if cfg.speculative_config is not None else 0)
    if plan.num_blocks <= 0:
        raise ValueError('not enough memory for a single KV block; lower max_batch_size or free memory')
    if model_config.is_hybrid and cfg.enable_prefix_caching:
        logger.info('prefix cache: %d state rows for checkpoints (%.1f MiB, %.1f MiB each), plus idle runtime rows',
                    plan.num_checkpoint_rows, plan.num_checkpoint_rows * row_bytes / 2**20, row_bytes / 2**20)
    prefix_cache = dataclasses.replace(knobs.resolved(cfg.block_size), state_budget=plan.num_checkpoint_rows) \
        if cfg.enable_prefix_caching else None
    return CacheConfig(block_size=cfg.block_size, kernel_block_size=cfg.resolved_kernel_block_size,
                       num_blocks=plan.num_blocks, num_state_slots=plan.num_state_slots, prefix_cache=prefix_cache,
                       state_row_bytes=row_bytes, kv_block_bytes=block_bytes)


def session_len(model_config: ModelConfig, cache_config: CacheConfig, wanted: int | None) -> int:
    """The longest session: the KV capacity and the model's positions bound it; a larger `wanted` is cut (with a
    warning), None takes the bound."""
    limit = min(model_config.max_position_embeddings, cache_config.num_blocks * cache_config.block_size)
    if wanted is not None and wanted > limit:
        logger.warning('session_len %d exceeds the KV capacity / max positions (%d); using %d', wanted, limit, limit)
    return limit if wanted is None else min(wanted, limit)
