"""Tensor-parallel reduction points of a model: where a rank's partial sums become the full activation.

Under `tp` ranks every row-parallel projection (attention `o_proj`, gated-delta `out_proj`, MLP and expert
`down_proj`, the shared expert's `down_proj`) multiplies the rank's slice of its input by the rank's slice of the
weight, so its output is a partial sum. A decoder layer therefore sums its token mixer's output and its MLP's
output over ranks (`AllReduce`), once each: a sparse MoE block's output (routed experts plus the gated shared
expert, both partial, the gate replicated) is linear in the partials, so one reduction covers both. Everything
between two reductions is rank-local (column-parallel projections, per-head norms, attention, the recurrent rule);
the embedding, the final norm and the head are replicated.

`AllReduce` is a plain callable attribute of its layer, not a module: it holds no parameter (the weight plan and
checkpoints never see it) and costs no `nn.Module` call. With no group attached (tp=1) it returns its input
untouched: one attribute check, no collective and nothing different inside CUDA graphs.
"""
from __future__ import annotations

import torch
from torch import nn


class AllReduce:
    """Sum of the input over the tensor-parallel group attached by `attach_tp_group` (identity without one)."""

    __slots__ = ('group',)

    def __init__(self):
        self.group = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return x
        import torch.distributed as dist
        dist.all_reduce(x, group=self.group)
        return x


def reduction_points(model: nn.Module) -> list[AllReduce]:
    """Every `AllReduce` held by a module of `model`."""
    return [value for module in model.modules() for value in vars(module).values() if isinstance(value, AllReduce)]


def attach_tp_group(model: nn.Module, group) -> int:
    """Make every `AllReduce` of `model` reduce over `group` (a `torch.distributed` process group); returns how
    many there are."""
    points = reduction_points(model)
    for point in points:
        point.group = group
    return len(points)
