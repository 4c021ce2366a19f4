"""Model construction without a throw-away copy: parameters on the meta device first, then allocated once on the
target device in their final dtype (FP8 layers are switched while still on meta), then filled from the checkpoint or
with dummy values.

Buffers (rotary frequencies) are computed at construction as usual; only `nn.Parameter`s are redirected to meta,
the trick accelerate's `init_empty_weights(include_buffers=False)` uses.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ..nn.blocked_fp8 import FP8_DTYPE

# Dummy weights are drawn in slices of at most this many elements, bounding the temporary memory of the draw.
_DUMMY_CHUNK = 1 << 26
_DUMMY_RANGE = 1e-3          # vLLM's dummy range: keeps activations finite through any depth
_DUMMY_FP8_SCALE = _DUMMY_RANGE / 2


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Inside this block every parameter registered on a module lives on the meta device (no memory)."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != 'meta':
            module._parameters[name] = nn.Parameter(param.to('meta'), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def materialize_(model: nn.Module, device: torch.device) -> None:
    """Allocate (uninitialised) every meta parameter on `device`; move buffers there too."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.device.type == 'meta':
                module._parameters[name] = nn.Parameter(torch.empty_like(param, device=device),
                                                        requires_grad=False)
        for name, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[name] = buf.to(device)


@torch.no_grad()
def fill_dummy_(model: nn.Module, seed: int = 0) -> None:
    """Random weights of the right shapes and dtypes, drawn on the parameters' device: uniform in +-1e-3 (FP8
    weights uniform in +-2 with block scales of 5e-4, the same real range)."""
    gen = None
    for name, param in model.named_parameters():
        if gen is None or gen.device != param.device:
            gen = torch.Generator(param.device).manual_seed(seed)
        _draw_into_(name, param.data, gen)


def draw_dummy_(model: nn.Module, device: torch.device, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, values) of every parameter of `model` (which may live on meta), each drawn on `device` in turn
    exactly as `fill_dummy_` would fill that model on `device`; one full parameter exists at a time (tensor
    parallelism shards each before the next is drawn)."""
    gen = torch.Generator(device).manual_seed(seed)
    for name, param in model.named_parameters():
        values = torch.empty(param.shape, dtype=param.dtype, device=device)
        _draw_into_(name, values, gen)
        yield name, values


def _draw_into_(name: str, tensor: torch.Tensor, gen: torch.Generator) -> None:
    flat = tensor.view(-1)
    if name.endswith('_scale_inv'):
        flat.fill_(_DUMMY_FP8_SCALE)
        return
    bound = 2.0 if tensor.dtype == FP8_DTYPE else _DUMMY_RANGE
    draw_dtype = torch.bfloat16 if tensor.dtype == FP8_DTYPE else tensor.dtype
    for start in range(0, flat.numel(), _DUMMY_CHUNK):
        piece = flat[start:start + _DUMMY_CHUNK]
        values = torch.empty(piece.shape, dtype=draw_dtype, device=tensor.device)
        values.uniform_(-bound, bound, generator=gen)
        piece.copy_(values)
