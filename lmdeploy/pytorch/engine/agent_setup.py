"""Builds the engine's device side: the model, its pools and the agent that runs it, on one rank or across
tensor-parallel ranks. Holds no state: the engine keeps what these functions return.

Order of building (`Engine.__init__`):
1. `start_workers`: at tp > 1, ranks 1..tp-1 as worker processes (they load their shards meanwhile) and this
   process as rank 0 of the group (`rank0_device`: `cuda:0` on CUDA). At tp = 1 nothing starts: no process, no
   process group; the rest is the single-device path unchanged.
2. `load_model`: the full model (the MTP head too with speculation), or rank 0's shard attached to the group.
3. (engine) LoRA adapters; then `free_memory`: after the weights, the minimum over ranks at tp > 1; (engine) the
   cache config and the scheduler.
4. `make_agent_spec`, then `build_engine_agent`: rank 0's pools and agent, kernel tuning (before any capture, so
   graphs hold tuned tiles), the workers' pools and agents from the same `AgentSpec` (identical logical block and
   slot ids on every rank), `TPModelAgent` over them; last, CUDA graphs on every rank.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ...messages import PytorchEngineConfig
from ..config import CacheConfig, ModelConfig
from ..models.loader import build_model
from ..models.tp_load import build_rank_model
from ..nn.parallel import attach_tp_group
from .agent_spec import AgentSpec, build_agent
from .cache_engine import CacheEngine
from .cache_sizing import free_memory_bytes
from .model_agent import ModelAgent
from .spec_setup import num_draft_tokens
from .tp_agent import TPModelAgent
from .tp_worker import WorkerSpec
from .tp_workers import TPWorkers


def start_workers(cfg: PytorchEngineConfig, model_path: str, dtype: str) -> TPWorkers | None:
    """Ranks 1..tp-1, started and joined to the group with this process as rank 0; None at tp = 1."""
    if cfg.tp == 1:
        return None
    return TPWorkers.start(cfg.tp, cfg.device_type, WorkerSpec(model_path, dtype, cfg.state_dtype, cfg.load_format))


def rank0_device(cfg: PytorchEngineConfig, workers: TPWorkers | None) -> torch.device:
    """This process's device: rank 0 is pinned to `cuda:0` under tensor parallelism (rank r owns `cuda:r`)."""
    if workers is not None and cfg.device_type == 'cuda':
        return torch.device('cuda', 0)
    return torch.device(cfg.device_type)


def load_model(cfg: PytorchEngineConfig, model_path: str, device: torch.device, dtype: str,
               workers: TPWorkers | None) -> tuple[nn.Module, ModelConfig]:
    """The whole model at tp = 1; else rank 0's shard (its `ModelConfig` has rank 0's head counts)."""
    if workers is None:
        return build_model(model_path, device, dtype, cfg.device_type, cfg.state_dtype,
                           load_format=cfg.load_format, mtp=cfg.speculative_config is not None)
    model, model_config = build_rank_model(model_path, device, dtype, cfg.device_type, cfg.tp, 0, cfg.state_dtype,
                                           cfg.load_format)
    attach_tp_group(model, workers.group)
    return model, model_config


def free_memory(cfg: PytorchEngineConfig, device: torch.device, workers: TPWorkers | None) -> int | None:
    """Free device memory to size the pools by (None: `num_gpu_blocks` fixes them). At tp > 1 it waits for every
    worker's shard (always, fixed pools too) and is the least over ranks."""
    free = None if cfg.num_gpu_blocks else free_memory_bytes(device)
    if workers is not None:
        least = workers.finish_start(free or 0)
        free = None if free is None else least
    return free


def make_agent_spec(cfg: PytorchEngineConfig, cache_config: CacheConfig, model_config: ModelConfig,
                    session_len: int, has_lora: bool) -> AgentSpec:
    """Every rank's pool geometry and graph buckets; a speculative engine also replays graphs of its verify
    forwards and draft head (`spec_graphs.py`)."""
    use_graphs = cfg.device_type == 'cuda' and not cfg.eager_mode
    return AgentSpec(
        cache_config, cfg.device_type, record_routed_experts=cfg.enable_return_routed_experts,
        cuda_graph_batch_size=cfg.max_batch_size if use_graphs else 0,
        max_pages_per_seq=-(-session_len // cache_config.kernel_block_size), has_lora=has_lora,
        max_prefill_tokens=cfg.max_prefill_token_num, max_batch_size=cfg.max_batch_size,
        num_draft_tokens=num_draft_tokens(cfg),
        vision_cache_bytes=cfg.vision_encoder_cache_mb << 20 if model_config.image_token_id is not None else 0)


def build_engine_agent(model: nn.Module, model_config: ModelConfig, spec: AgentSpec, device: torch.device,
                       workers: TPWorkers | None, on_failure: Callable[[], None], max_tokens: int
                       ) -> tuple[CacheEngine, ModelAgent | TPModelAgent]:
    """Rank 0's pools and agent (`TPModelAgent` over the workers at tp > 1), kernels tuned for forwards of up to
    `max_tokens` tokens, then the CUDA graphs. `on_failure` runs (on the workers' monitor thread) when a rank dies.
    tp > 1 loads FP8 dequantized: the workers have no FP8 GEMM to tune."""
    cache_engine, agent = build_agent(model, model_config, spec, device)
    agent.tune_kernels(max_tokens)
    if workers is not None:
        workers.setup(spec)
        workers.on_failure = on_failure
        agent = TPModelAgent(agent, workers)
    agent.capture_cuda_graphs()
    return cache_engine, agent
