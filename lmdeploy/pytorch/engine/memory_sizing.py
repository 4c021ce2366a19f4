"""Memory sizing: how many state rows and KV blocks the engine gets, and the session length they allow.

Pure functions of the model's geometry (`ModelConfig`), the user's `PytorchEngineConfig` and the free memory, so
they are tested without a model. Runs once, in `Engine.__init__`, after the weights are loaded (the memory they
took is no longer free) and before the pools are allocated.
"""
from __future__ import annotations

import logging
import os

import torch

from ...messages import PytorchEngineConfig
from ..config import CacheConfig, ModelConfig
from .cache_engine import kv_block_bytes, state_row_layout

logger = logging.getLogger('lmdeploy')
# The KV budget on CPU: a quarter of physical memory, at most this much.
CPU_CACHE_BUDGET = 1 << 30


def num_state_slots(model_config: ModelConfig, engine_config: PytorchEngineConfig) -> int:
    """Rows of the state pool: the dummy row 0, one per running sequence, a spare for the batch being scheduled,
    and the checkpoint budget (0 for models without recurrent layers)."""
    if not model_config.is_hybrid:
        return 0
    return 1 + engine_config.max_batch_size + 1 + engine_config.prefix_cache.state_budget


def free_memory_bytes(device: torch.device) -> int:
    """Memory the KV pool may take from: free device memory on CUDA, a fixed budget on CPU."""
    if device.type == 'cuda':
        free, _ = torch.cuda.mem_get_info(device)
        return free
    total = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
    return min(total // 4, CPU_CACHE_BUDGET)


def blocks_from_memory(free_bytes: int, block_bytes: int, state_bytes: int, cache_max_entry_count: float) -> int:
    """KV blocks in `cache_max_entry_count` of the memory left after the state pool."""
    return int((free_bytes - state_bytes) * cache_max_entry_count) // block_bytes


def make_cache_config(model_config: ModelConfig, engine_config: PytorchEngineConfig, free_bytes: int | None
                      ) -> CacheConfig:
    """The pools' geometry: `num_gpu_blocks` when positive, else sized from `free_bytes` (needed only then).
    `ValueError` when not even one KV block fits."""
    cfg = engine_config
    num_slots = num_state_slots(model_config, cfg)
    _, row_bytes = state_row_layout(model_config)
    block_bytes = kv_block_bytes(model_config, cfg.block_size, getattr(torch, model_config.dtype))
    num_blocks = cfg.num_gpu_blocks or blocks_from_memory(free_bytes, block_bytes, num_slots * row_bytes,
                                                          cfg.cache_max_entry_count)
    if num_blocks <= 0:
        raise ValueError('not enough memory for a single KV block; lower max_batch_size or free memory')
    return CacheConfig(block_size=cfg.block_size, kernel_block_size=cfg.resolved_kernel_block_size,
                       num_blocks=num_blocks, num_state_slots=num_slots,
                       prefix_cache=cfg.prefix_cache.resolved(cfg.block_size) if cfg.enable_prefix_caching else None,
                       state_row_bytes=row_bytes, kv_block_bytes=block_bytes)


def session_len(model_config: ModelConfig, cache_config: CacheConfig, wanted: int | None) -> int:
    """The longest session: the KV capacity and the model's positions bound it; a larger `wanted` is cut (with a
    warning), None takes the bound."""
    limit = min(model_config.max_position_embeddings, cache_config.num_blocks * cache_config.block_size)
    if wanted is not None and wanted > limit:
        logger.warning('session_len %d exceeds the KV capacity / max positions (%d); using %d', wanted, limit, limit)
    return limit if wanted is None else min(wanted, limit)
