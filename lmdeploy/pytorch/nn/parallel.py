"""Tensor-parallel reduction points of a model: where a rank's partial sums become the full activation.

Under `tp` ranks every row-parallel projection (attention `o_proj`, gated-delta `out_proj`, MLP and expert
`down_proj`, the shared expert's `down_proj`) multiplies the rank's slice of its input by the rank's slice of the
weight, so its output is a partial sum. A decoder layer therefore sums its token mixer's output and its MLP's
output over ranks (`AllReduce`), once each: a sparse MoE block's output (routed experts plus the gated shared
expert, both partial, the gate replicated) is linear in the partials, so one reduction covers both. Everything
between two reductions is rank-local (column-parallel projections, per-head norms, attention, the recurrent rule);
the embedding, the final norm and the head are replicated.

`AllReduce` holds no parameter (the weight plan and checkpoints never see it). With no group attached (tp=1) its
forward returns its input untouched: one attribute check, no collective and nothing different inside CUDA graphs.
"""
from __future__ import annotations

import torch
from torch import nn


class AllReduce(nn.Module):
    """Sum of the input over the tensor-parallel group attached by `attach_tp_group` (identity without one)."""

    def __init__(self):
        super().__init__()
        self.group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return x
        import torch.distributed as dist
        dist.all_reduce(x, group=self.group)
        return x


def attach_tp_group(model: nn.Module, group) -> int:
    """Make every `AllReduce` of `model` reduce over `group` (a `torch.distributed` process group); returns how
    many there are (a model with none cannot run sharded, and the caller refuses it)."""
    points = [m for m in model.modules() if isinstance(m, AllReduce)]
    for point in points:
        point.group = group
    return len(points)
