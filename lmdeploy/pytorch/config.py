"""Internal configuration records shared by every layer of the PyTorch engine.

`ModelConfig` is what the engine needs to know about a model (cache geometry, recurrent state shapes, stop ids);
`CacheConfig` and `SchedulerConfig` are resolved from the user's `PytorchEngineConfig`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..prefix_cache_config import PrefixCacheConfig


@dataclass(frozen=True)
class StateSpec:
    """Shape and dtype (as a torch dtype name) of one per-sequence recurrent tensor."""
    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    # Full-attention layers that own KV cache (layer indices in forward order).
    attn_layer_ids: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    dtype: str
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # Recurrent layers (hybrid models): layer indices and the per-layer state tensors kept in a state-pool row.
    recurrent_layer_ids: tuple[int, ...] = ()
    state_specs: tuple[StateSpec, ...] = ()
    # Vision-language models: the image placeholder token (each image's span holds only it); None without a tower.
    image_token_id: int | None = None
    # MoE layers (layer indices in forward order) and how many experts each routes a token to; the routed-experts
    # record of a token is `[len(moe_layer_ids), moe_top_k]` expert ids in this layer order. Empty for dense models.
    moe_layer_ids: tuple[int, ...] = ()
    moe_top_k: int = 0
    # MTP head layers built for speculative decoding (0: none). Their attention keeps KV in extra KV-pool layers
    # after the target's, at cache indices `num_attn_layers + i`, under the same logical block ids.
    num_mtp_layers: int = 0

    @property
    def is_hybrid(self) -> bool:
        return len(self.recurrent_layer_ids) > 0

    @property
    def num_attn_layers(self) -> int:
        return len(self.attn_layer_ids)

    @property
    def num_kv_layers(self) -> int:
        """KV-pool layers: the target's attention layers, then the MTP head's."""
        return len(self.attn_layer_ids) + self.num_mtp_layers

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layer_ids)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    kernel_block_size: int
    num_blocks: int
    # Rows of the state pool (row 0 is a reserved dummy); 0 for models without recurrent layers.
    num_state_slots: int = 0
    # The prefix-cache knobs resolved to `block_size` (`PrefixCacheConfig.resolved`); None: prefix caching off.
    prefix_cache: PrefixCacheConfig | None = None
    # Sizes for eviction by value (bytes of one state row / one KV block across layers).
    state_row_bytes: int = 0
    kv_block_bytes: int = 0

    @property
    def enable_prefix_caching(self) -> bool:
        return self.prefix_cache is not None

    @property
    def pages_per_block(self) -> int:
        return self.block_size // self.kernel_block_size


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int
    max_prefill_token_num: int
    session_len: int
    extra: dict = field(default_factory=dict)
