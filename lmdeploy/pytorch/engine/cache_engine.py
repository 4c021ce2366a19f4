"""Device memory of the caches: the packed KV pool and the recurrent-state pool.

Owns: the two pool tensors and the typed views models read through `StepContext`. It never decides what goes
where (that is the scheduler's job); it only allocates, views and copies.

KV pool: one contiguous uint8 tensor `[num_kv_layers, num_pages, page_bytes]` (the target's attention
layers, then the MTP head's, if built); a page row holds K then V for
`kernel_block_size` tokens. A scheduler block is `pages_per_block` contiguous pages.
State pool: one uint8 tensor `[num_slots, row_bytes]`; a row holds every recurrent layer's state tensors at fixed,
16-byte-aligned offsets, so saving or restoring a sequence's state is one row copy.
"""
from __future__ import annotations

import torch

from ..backends.base import Backend, OpType
from ..config import CacheConfig, ModelConfig

_ALIGN = 16


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _elem_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def kv_page_bytes(model_config: ModelConfig, kernel_block_size: int, dtype: torch.dtype) -> int:
    return 2 * kernel_block_size * model_config.num_kv_heads * model_config.head_dim * _elem_size(dtype)


def kv_block_bytes(model_config: ModelConfig, cache_config_block_size: int, dtype: torch.dtype) -> int:
    """Bytes one scheduler block takes across all KV-pool layers (MTP head included)."""
    return model_config.num_kv_layers * kv_page_bytes(model_config, cache_config_block_size, dtype)


def mtp_hidden_bytes(model_config: ModelConfig) -> int:
    """Bytes of the draft head's hidden entry at the end of a state row (0 without an MTP head)."""
    if not model_config.num_mtp_layers:
        return 0
    return model_config.hidden_size * _elem_size(_dtype(model_config.dtype))


def state_row_layout(model_config: ModelConfig) -> tuple[list[dict[str, tuple[int, int]]], int]:
    """Per recurrent layer: name -> (byte offset, byte size) inside a row; plus the row size (which ends with the
    MTP head's hidden entry when the head is built, see `CacheEngine.mtp_hidden`)."""
    layout, offset = [], 0
    for _ in model_config.recurrent_layer_ids:
        entry = {}
        for spec in model_config.state_specs:
            size = _elem_size(_dtype(spec.dtype))
            for dim in spec.shape:
                size *= dim
            entry[spec.name] = (offset, size)
            offset += -(-size // _ALIGN) * _ALIGN
        layout.append(entry)
    return layout, offset + -(-mtp_hidden_bytes(model_config) // _ALIGN) * _ALIGN


class CacheEngine:

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, device: torch.device,
                 backend: Backend | None = None):
        if backend is None:
            from ..backends.selector import get_backend
            backend = get_backend('default')
        self._copy_blocks = backend.build(OpType.CacheBlockCopy)
        self._copy_slots = backend.build(OpType.StateSlotCopy)
        self.model_config = model_config
        self.cache_config = cache_config
        self.device = device
        self.dtype = _dtype(model_config.dtype)
        kbs = cache_config.kernel_block_size
        self.num_pages = cache_config.num_blocks * cache_config.pages_per_block
        page_bytes = kv_page_bytes(model_config, kbs, self.dtype)
        # Never zero-filled: every KV position is written before it is read (kernels mask by kv_len), and touching
        # GiBs of pages up front costs seconds and resident memory on CPU.
        self.kv_pool = torch.empty(model_config.num_kv_layers, self.num_pages, page_bytes,
                                   dtype=torch.uint8, device=device)
        self.kv_caches = [self._kv_views(layer) for layer in range(model_config.num_kv_layers)]
        self.state_layout, row_bytes = state_row_layout(model_config)
        num_slots = cache_config.num_state_slots if model_config.is_hybrid else 0
        self.state_pool = torch.zeros(num_slots, max(row_bytes, _ALIGN), dtype=torch.uint8, device=device)
        self.state_caches = [self._state_views(entry) for entry in self.state_layout]
        # MTP: the target's pre-norm hidden state of the last token a row's state has consumed ([num_slots, H], the
        # row's last bytes), i.e. what the draft head reads for the position before a resume. It travels with every
        # state copy (save, restore, draft fix-up), so a checkpoint at step s holds h_{s-1}.
        self.mtp_hidden = None
        hidden_bytes = mtp_hidden_bytes(model_config)
        if hidden_bytes and num_slots:
            start = row_bytes - -(-hidden_bytes // _ALIGN) * _ALIGN
            self.mtp_hidden = self.state_pool[:, start:start + hidden_bytes].view(self.dtype).view(
                num_slots, model_config.hidden_size)

    def _kv_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.model_config
        pages = self.kv_pool[layer].view(self.dtype).view(
            self.num_pages, 2, self.cache_config.kernel_block_size, cfg.num_kv_heads, cfg.head_dim)
        return pages[:, 0], pages[:, 1]

    def _state_views(self, entry: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
        views = {}
        for spec in self.model_config.state_specs:
            offset, size = entry[spec.name]
            raw = self.state_pool[:, offset:offset + size]
            views[spec.name] = raw.view(_dtype(spec.dtype)).view(self.state_pool.size(0), *spec.shape)
        return views

    def copy_logical_blocks(self, plan: torch.Tensor) -> None:
        """Copy logical blocks `plan[0] -> plan[1]` (validated physical offsets), all pages, every layer."""
        self._copy_blocks(self.kv_pool, plan[0], plan[1], self.cache_config.pages_per_block)

    def copy_state_slots(self, plan: torch.Tensor) -> None:
        """Copy whole state rows `plan[0] -> plan[1]`."""
        if self.state_pool.size(0):
            self._copy_slots(self.state_pool, plan[0], plan[1])

    @property
    def kv_pool_bytes(self) -> int:
        return self.kv_pool.numel()

    @property
    def state_pool_bytes(self) -> int:
        return self.state_pool.numel()
