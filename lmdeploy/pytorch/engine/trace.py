"""Named host phases of an engine step, for `torch.profiler` timelines (`benchmark/profile_prefill.py --phases`).

`phase(name)` is a `record_function` range while a profiler records, and a shared no-op context otherwise (one C
call per phase), so the step's hot path pays nothing measurable when nobody profiles. Names start with
`lmdeploy.`; `benchmark/kernel_profile.print_phases` lists them beside the device time inside each.
"""
from __future__ import annotations

import contextlib

import torch

_IDLE = contextlib.nullcontext()


def phase(name: str):
    """A profiler range named `lmdeploy.<name>` while a profiler records; a no-op context otherwise."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(f'lmdeploy.{name}')
    return _IDLE
