"""Forward-stream discipline for CUDA: inputs go host-to-device on a side stream, the forward runs on its own
stream, and every device tensor of every payload is recorded on the forward stream.

Why `record_stream`: a tensor allocated on the copy stream belongs to that stream's allocator pool; once the Python
object dies, the allocator may hand its memory to the next copy while the forward stream still reads it. Recording
the tensor on the forward stream delays reuse until the forward's queued work is done.

Payload types register how to list their device tensors. A payload without tensors says so with
`register_payload(cls, None)`; an unregistered payload type fails loudly.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from ..model_inputs import ModelInputs, SamplingInputs
from .cache_inputs import CacheCheckpointInputs

_PAYLOADS: dict[type, Callable[[object], list[torch.Tensor]] | None] = {}


def register_payload(cls: type, tensors: Callable[[object], list[torch.Tensor]] | None) -> None:
    _PAYLOADS[cls] = tensors


def payload_tensors(payload: object) -> list[torch.Tensor]:
    if payload is None:
        return []
    if type(payload) not in _PAYLOADS:
        raise TypeError(f'unknown payload type {type(payload).__name__}: register it with register_payload '
                        '(use None for a payload that holds no tensors)')
    lister = _PAYLOADS[type(payload)]
    return [] if lister is None else lister(payload)


register_payload(ModelInputs, ModelInputs.tensors)
register_payload(SamplingInputs, SamplingInputs.tensors)
register_payload(CacheCheckpointInputs, CacheCheckpointInputs.tensors)


class DeviceStreams:
    """On CUDA: a forward stream and a copy stream ordered by an event. On CPU: plain synchronous copies."""

    def __init__(self, device: torch.device):
        self.device = device
        self.is_cuda = device.type == 'cuda'
        self.forward_stream = torch.cuda.Stream(device) if self.is_cuda else None
        self.copy_stream = torch.cuda.Stream(device) if self.is_cuda else None

    def to_device(self, *payloads):
        """Copy payloads to the device; on CUDA the forward stream waits for the copies and every resulting device
        tensor is recorded on the forward stream."""
        for payload in payloads:
            payload_tensors(payload)  # fail loudly on an unknown payload type before any copy
        if not self.is_cuda:
            return tuple(p.to(self.device) if p is not None else None for p in payloads)
        with torch.cuda.stream(self.copy_stream):
            moved = tuple(p.to(self.device, non_blocking=True) if p is not None else None for p in payloads)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        self.forward_stream.wait_event(done)
        for payload in moved:
            for tensor in payload_tensors(payload):
                if tensor.is_cuda:
                    tensor.record_stream(self.forward_stream)
        return moved

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Run the enclosed device work on the forward stream."""
        if not self.is_cuda:
            yield
            return
        with torch.cuda.stream(self.forward_stream):
            yield
