"""Host inputs of a forward in one pinned non-blocking copy: speculative steps (`ModelAgent.forward_verify` and
`ModelAgent.draft`, by default; `LMDEPLOY_SPEC_CHAIN_GRAPH=0` turns it off with the chain graph, see `spec_chain`)
and plain forwards (`ModelAgent.forward`, `forward_logits`; by default since H200 run 9 passed the engine's gpu tests
with it, `LMDEPLOY_PACKED_UPLOAD=0` turns it off). The byte layout is tested on the CPU, the CUDA copy by a gpu test
that passed on the H200 in runs 6 and 9, 2026-12-01.

`DeviceStreams.to_device` copies every tensor of a payload on its own, from pageable memory: a dozen copies per
`ModelInputs`, each one a round trip the host waits for before it can queue the forward. Here the top-level host
tensors of several dataclass payloads (`ModelInputs`, `CacheCheckpointInputs`: every tensor they hold is a direct
field) travel as the bytes of one pinned buffer, each piece padded to 16 bytes so that every piece's view keeps its
dtype's alignment, copied non-blocking on the current stream (the forward stream: the payloads are allocated there
and need no `record_stream`). Every other field is kept as it is (`dataclasses.replace`, so per-forward memos start
empty). Off CUDA: plain `.to(device)`. Values and dtypes come back exactly (a byte copy).
"""
from __future__ import annotations

import dataclasses
import functools
import os

import numpy as np
import torch

_ALIGN = 16


def packed_uploads_enabled() -> bool:
    """Plain forwards upload their inputs packed unless `LMDEPLOY_PACKED_UPLOAD=0` (see the module docstring)."""
    return os.environ.get('LMDEPLOY_PACKED_UPLOAD', '1') != '0'


@functools.cache
def _init_fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.init)


def _host_tensors(payload) -> dict[str, torch.Tensor]:
    out = {}
    for name in _init_fields(type(payload)):
        value = getattr(payload, name)
        if isinstance(value, torch.Tensor) and not value.is_cuda:
            out[name] = value
    return out


def upload_packed(payloads: list, device: torch.device, pack: bool | None = None) -> list:
    """The payloads (dataclasses with tensor fields, or None) with their host tensors on `device`. `pack`: through
    one packed buffer (default: on CUDA only; the CPU tests pack to check the byte layout)."""
    if not (device.type == 'cuda' if pack is None else pack):
        return [None if p is None else p.to(device) for p in payloads]
    fields, spans, size = _layout(payloads)
    if not fields:
        return list(payloads)
    host = np.zeros(size, dtype=np.uint8)
    _write(host, fields, spans)
    packed = torch.from_numpy(host)
    if device.type == 'cuda':
        packed = packed.pin_memory()
    return _views(payloads, fields, spans, packed.to(device, non_blocking=True))


def pack_into(payloads: list, host: np.ndarray, device_bytes: torch.Tensor,
              skip: dict[int, frozenset[str]] | None = None) -> list | None:
    """The payloads' host tensors written into `host` (uint8) as `upload_packed` lays them out, and the payloads
    with those tensors replaced by views of `device_bytes` (uint8, as long as `host`; the caller copies `host`
    there). None if they do not fit. `skip`: fields left as they are, by payload index."""
    fields, spans, size = _layout(payloads, skip)
    if size > host.size:
        return None
    _write(host, fields, spans)
    return _views(payloads, fields, spans, device_bytes)


def _layout(payloads: list, skip: dict[int, frozenset[str]] | None = None
            ) -> tuple[list, list[tuple[int, int]], int]:
    """(payload index, field, tensor) of every host tensor (less `skip`), each one's (start, bytes) in the packed
    buffer, and the buffer's size: each piece starts at a multiple of `_ALIGN`, so its view keeps its dtype's
    alignment."""
    skip = skip or {}
    fields = [(i, name, t) for i, p in enumerate(payloads) if p is not None
              for name, t in _host_tensors(p).items() if name not in skip.get(i, ())]
    spans, at = [], 0
    for _, _, t in fields:
        nbytes = t.numel() * t.element_size()
        spans.append((at, nbytes))
        at += nbytes + (-nbytes % _ALIGN)
    return fields, spans, at


def _write(host: np.ndarray, fields: list, spans: list[tuple[int, int]]) -> None:
    for (_, _, t), (start, size) in zip(fields, spans):  # numpy views: a few microseconds a tensor on the host
        host[start:start + size] = t.reshape(-1).view(torch.uint8).numpy()


def _views(payloads: list, fields: list, spans: list[tuple[int, int]], device_bytes: torch.Tensor) -> list:
    moved: list[dict[str, torch.Tensor]] = [{} for _ in payloads]
    for (i, name, t), (start, size) in zip(fields, spans):
        moved[i][name] = device_bytes[start:start + size].view(t.dtype).view(t.shape)
    return [None if p is None else dataclasses.replace(p, **moved[i]) for i, p in enumerate(payloads)]


def packable(payload) -> bool:
    """Whether `upload_packed` moves every tensor of `payload` (a dataclass whose `tensors()` are all direct fields;
    e.g. `SamplingInputs` with penalty or bias lists is not)."""
    return dataclasses.is_dataclass(payload) and len(payload.tensors()) == len(_host_tensors(payload))
