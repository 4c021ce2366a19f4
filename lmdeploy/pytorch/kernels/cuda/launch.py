"""Cheap launches of our Triton kernels: after the first compile of a specialization, call its compiled handle.

`JITFunction.__call__` (`kernel[grid](...)`) binds arguments, computes Triton's specialization of every argument,
hashes it with the options into a cache key, checks the kernel's globals and builds launch metadata on every call:
tens of microseconds of Python per launch, for kernels whose device time is often a few microseconds. `FastKernel`
wraps a `@triton.jit` function and keeps its own cache from a cheaper key to the `CompiledKernel`; a hit calls
`CompiledKernel.run` directly, the way Triton's own launcher does after its lookup.

Key (invariant: two calls with the same key have the same Triton specialization, so they may share a binary):
- the current device and the launch options (`num_warps`, `num_stages`, ...);
- every constexpr parameter's value;
- every tensor's dtype and whether its data pointer is 16-byte aligned (Triton's pointer specialization);
- every int's width class (i32 / i64 / u64), whether it equals 1 and whether it is divisible by 16 (Triton
  specializes ints on both), the last two left out for parameters named in `triton.jit(do_not_specialize=...)`,
  which Triton compiles once for every value of the width class;
- the type of every other value (floats, bools, None).
The key is at least as fine as Triton's, so a hit never runs a binary compiled for another specialization. A miss
launches through `JITFunction` (compiling if needed) and stores the `CompiledKernel` it returns.

Under `TRITON_INTERPRET=1` (CPU tests) `triton.jit` builds an interpreted function; `FastKernel` then always takes
the normal path. So does any call while a Triton launch hook is installed (profilers such as proton), so hooks
still see every launch, and every call when the environment sets `LMDEPLOY_FAST_LAUNCH=0` (read at import; for
before/after measurements, `benchmark/bench_host_per_layer.py`).

Programmatic dependent launch (PDL, Hopper and later): a kernel with a ``PDL: tl.constexpr = False`` parameter
whose body starts with `wait_for_inputs(PDL)` is launched, on a device of compute capability 9 or more, with
``PDL=True`` and Triton's ``launch_pdl`` option (the CUDA launch attribute of programmatic stream serialization).
The driver may then start its programs while the previous kernel on the stream is still running; each program
first waits (``griddepcontrol.wait``) until that kernel has completed and its writes are visible, then lets the
next kernel start the same way (``griddepcontrol.launch_dependents``). Nothing is written before the wait, and
nothing is read there but model weights (`gemv.py` loads its first weight step), which only start-up writes: the
order of effects is the stream's. What is gained is the launch and scheduling latency between two kernels, which
a decode step pays hundreds of times (CUDA graphs keep the attribute as a programmatic edge).
Off with `LMDEPLOY_PDL=0` (read at import), on older GPUs, under the interpreter, and for a caller that passes
``PDL`` itself; independent of `LMDEPLOY_FAST_LAUNCH`.
"""
from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime.jit import JITFunction

_INT32_MIN, _INT32_MAX, _UINT64_MIN = -(2 ** 31), 2 ** 31 - 1, 2 ** 63
_ENABLED = os.environ.get('LMDEPLOY_FAST_LAUNCH', '1') != '0'
_PDL_ENABLED = os.environ.get('LMDEPLOY_PDL', '1') != '0' and os.environ.get('TRITON_INTERPRET', '0') != '1'
_DEFAULT_SMS = 132  # the H200's SM count: what interpreted (CPU) runs size their grids for


@functools.cache
def device_sm_count(device: torch.device) -> int:
    """The device's SM count, which launch rules size grids by (132, the H200's, off CUDA: interpreted runs then
    decide as on that GPU)."""
    if device.type != 'cuda':
        return _DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def pdl_supported(device_index: int) -> bool:
    """Whether kernels on CUDA device `device_index` launch with PDL (see the module docstring)."""
    return _PDL_ENABLED and torch.cuda.get_device_capability(device_index)[0] >= 9


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """A PDL kernel's first statement: wait for the previous kernel on the stream, then let the next one launch
    (both no-ops without PDL; see the module docstring)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def arg_key(arg: Any, specialize: bool = True) -> Any:
    """The part of Triton's specialization an argument decides (see the module docstring; also the warm-up's key of a
    launch's integer classes, `moe.warm_up_token_counts`); `specialize=False` for a
    `do_not_specialize` parameter."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() & 15 == 0
    if arg.__class__ is int:
        if not specialize:
            return _INT32_MIN <= arg <= _INT32_MAX, arg >= _UINT64_MIN
        return arg == 1, arg & 15 == 0, _INT32_MIN <= arg <= _INT32_MAX, arg >= _UINT64_MIN
    return arg.__class__


def _has_hook(hook: Any) -> bool:
    """Whether a Triton launch hook is installed (a non-empty `HookChain` in Triton >= 3.5, a callable before)."""
    return hook is not None and getattr(hook, 'calls', True) != []


class FastKernel:
    """A `@triton.jit` kernel launched as `kernel[grid](*args, **kwargs)`, like the function it wraps."""

    def __init__(self, fn: Any):
        self.fn = fn
        # Interpreted kernels (TRITON_INTERPRET=1) and anything that is not a plain JITFunction take the normal path.
        self.is_fast = _ENABLED and isinstance(fn, JITFunction)
        self.has_pdl = _PDL_ENABLED and isinstance(fn, JITFunction) and 'PDL' in fn.arg_names
        if self.is_fast:
            self.arg_names: list[str] = list(fn.arg_names)
            self.is_constexpr = [p.is_constexpr for p in fn.params]
            self.specialize = [not p.do_not_specialize for p in fn.params]
            self.defaults = {name: param.default for name, param in fn.signature.parameters.items()
                             if param.default is not param.empty}
        self._compiled: dict[tuple, Any] = {}
        self._current_device = self._current_stream = None  # the active driver's functions, bound at first launch

    @property
    def num_compiled(self) -> int:
        """Specializations this wrapper holds a compiled handle for (tests read it)."""
        return len(self._compiled)

    def __getitem__(self, grid: tuple[int, ...]):
        def launch(*args, **kwargs):
            return self.launch(grid, *args, **kwargs)
        return launch

    def _bind(self, args: tuple, kwargs: dict) -> tuple[list, dict]:
        """(every parameter's value in signature order, the remaining launch options)."""
        values = list(args)
        for name in self.arg_names[len(args):]:
            if name in kwargs:
                values.append(kwargs.pop(name))
            elif name in self.defaults:
                values.append(self.defaults[name])
            else:
                raise TypeError(f'{self.fn.__name__}: missing argument {name!r}')
        return values, kwargs

    def launch(self, grid: tuple[int, ...], *args, **kwargs) -> None:
        if self.has_pdl or self.is_fast:
            if self._current_device is None:
                active = triton.runtime.driver.active
                self._current_device, self._current_stream = active.get_current_device, active.get_current_stream
            device = self._current_device()
            if self.has_pdl and 'PDL' not in kwargs and pdl_supported(device):
                kwargs = dict(kwargs, PDL=True, launch_pdl=True)
        hooks = triton.knobs.runtime
        if not self.is_fast or _has_hook(hooks.launch_enter_hook) or _has_hook(hooks.launch_exit_hook):
            self.fn[grid](*args, **kwargs)
            return
        values, options = self._bind(args, kwargs)
        key = (device, tuple(sorted(options.items())),
               tuple(v if c else arg_key(v, s) for v, c, s in zip(values, self.is_constexpr, self.specialize)))
        kernel = self._compiled.get(key)
        if kernel is None:
            kernel = self.fn[grid](*values, **options)
            if hasattr(kernel, 'result'):  # asynchronous compilation hands back a future
                kernel = kernel.result()
            self._compiled[key] = kernel
            return
        num = len(grid)
        kernel.run(grid[0], grid[1] if num > 1 else 1, grid[2] if num > 2 else 1, self._current_stream(device),
                   kernel.function, kernel.packed_metadata, None, None, None, *values)


def fast_kernel(fn: Any) -> FastKernel:
    """Decorator over `@triton.jit`: `@fast_kernel @triton.jit def _kernel(...)`. Only for kernels launched from the
    host; a `@triton.jit` helper called from other kernels must stay a plain JITFunction."""
    return FastKernel(fn)


_arrivals: dict[tuple[str, torch.device], torch.Tensor] = {}


def arrival_counters(name: str, size: int, device: torch.device) -> torch.Tensor:
    """`size` int32 counters for kernel family `name` on `device`, zero between launches, for the pattern where the
    last of a group of programs to finish (an acq_rel `tl.atomic_add` on its group's counter returns the group size
    less one) does the group's epilogue and puts the counter back to 0. Allocated once and shared by every launch of
    the family on the device, which the one forward stream orders; CUDA graphs capture the fixed address."""
    key = (name, device)
    counters = _arrivals.get(key)
    if counters is None:
        counters = _arrivals[key] = torch.zeros(size, dtype=torch.int32, device=device)
    assert counters.numel() == size, f'{name}: counters allocated with {counters.numel()}, asked {size}'
    return counters
