"""Backend dispatch: layers ask for an implementation by `OpType`; each backend maps op types to builders.

Models and nn layers never import kernels directly. A backend is a table `OpType -> builder`, where a builder is
a callable returning the implementation object (usually a plain function or a small callable class). A missing
entry falls back to the `default` backend's builder, so a device backend only overrides what it accelerates.
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any


class OpType(enum.Enum):
    Embedding = enum.auto()
    Linear = enum.auto()
    LinearBlockedF8 = enum.auto()
    RMSNorm = enum.auto()
    AddRMSNorm = enum.auto()
    RMSNormLinear = enum.auto()
    GatedRMSNorm = enum.auto()
    ApplyRotary = enum.auto()
    SiluAndMul = enum.auto()
    SigmoidGateMul = enum.auto()
    PagedAttention = enum.auto()
    VisionAttention = enum.auto()
    GatedDeltaGating = enum.auto()
    GatedDeltaRule = enum.auto()
    CausalConv1d = enum.auto()
    SoftmaxTopK = enum.auto()
    NormRoute = enum.auto()
    MoE = enum.auto()
    MoEBlockedF8 = enum.auto()
    CacheBlockCopy = enum.auto()
    StateSlotCopy = enum.auto()
    Sampling = enum.auto()
    LoRA = enum.auto()


Builder = Callable[..., Any]


class Backend:
    """A named table of builders with an optional parent to fall back on."""

    def __init__(self, name: str, builders: dict[OpType, Builder], parent: Backend | None = None):
        self.name = name
        self._builders = dict(builders)
        self._parent = parent

    def get_builder(self, op_type: OpType) -> Builder:
        builder = self._builders.get(op_type)
        if builder is not None:
            return builder
        if self._parent is not None:
            return self._parent.get_builder(op_type)
        raise NotImplementedError(f'backend {self.name!r} has no implementation of {op_type.name}')

    def build(self, op_type: OpType, **kwargs) -> Any:
        return self.get_builder(op_type)(**kwargs)
