"""`AgentSpec`: everything besides the model that builds a rank's `CacheEngine` and `ModelAgent`, as one picklable
record, so rank 0 (the engine process) and every tensor-parallel worker build theirs from the same values: the same
pool geometry (identical logical block and slot ids on every rank), the same CUDA-graph buckets and flags."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..backends.selector import get_backend
from ..config import CacheConfig, ModelConfig
from .cache_engine import CacheEngine
from .model_agent import ModelAgent


@dataclass(frozen=True)
class AgentSpec:
    cache_config: CacheConfig
    device_type: str
    cuda_graph_batch_size: int = 0
    max_pages_per_seq: int = 0
    record_routed_experts: bool = False
    has_lora: bool = False
    vision_cache_bytes: int = 0
    max_prefill_tokens: int = 8192
    max_batch_size: int = 1  # the scheduler's; bounds the eager warm-up's batches (`warm_start.py`)
    num_draft_tokens: int = 0  # MTP speculative decoding (K drafts per verify; 0: off)


def build_agent(model: nn.Module, model_config: ModelConfig, spec: AgentSpec, device: torch.device
                ) -> tuple[CacheEngine, ModelAgent]:
    """The rank's pools (its shard: `model_config` is the rank's) and its agent."""
    backend = get_backend(spec.device_type)
    cache_engine = CacheEngine(model_config, spec.cache_config, device, backend)
    agent = ModelAgent(model, cache_engine, backend, device, cuda_graph_batch_size=spec.cuda_graph_batch_size,
                       max_pages_per_seq=spec.max_pages_per_seq, record_routed_experts=spec.record_routed_experts,
                       has_lora=spec.has_lora, vision_cache_bytes=spec.vision_cache_bytes,
                       max_prefill_tokens=spec.max_prefill_tokens, max_batch_size=spec.max_batch_size,
                       num_draft_tokens=spec.num_draft_tokens)
    return cache_engine, agent
