"""The kernel tables of the profile scripts (`profile_prefill.py`, `profile_decode.py`): device kernels from a
`torch.profiler` run, by name and by category, and the device's busy and idle time from the same records.

Categories are patterns over the lower-cased kernel name, first match wins ('other' when none does). On the CPU (the
smoke runs) the CPU ops stand in for kernels, by self time: the logic is checked, the figures mean nothing.
"""
from __future__ import annotations

import re
from collections import defaultdict

import torch

PHASE = 'lmdeploy.'  # the prefix of the engine's host phase ranges (`engine/trace.phase`)

# (category, pattern over the lower-cased kernel name), first match wins
CATEGORIES = [
    ('attention', r'prefill_kernel|merge_kernel|decode_split|decode_merge|flash|fmha|attention'),
    ('gated delta rule', r'chunk_|gated_delta|delta_rule|recurrent|solve_tril|wy_fast|w_u|cumsum|kkt|l2norm'),
    ('conv', r'conv'),
    ('moe', r'moe|expert|topk|align'),
    ('gemm', r'gemm|nvjet|xmma|cutlass|sm90|sm80|ampere|matmul|wgmma|cublas'),
    ('activation', r'silu_and_mul|sigmoid_gate'),
    ('norm / rotary / fill', r'norm|rotary|rope|fill_kv|gating'),
    ('copy', r'copy|memcpy|memset|cat|index'),
]


def category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, pattern in CATEGORIES if re.search(pattern, low)), 'other')


def device_time_us(evt) -> float:
    for attr in ('self_device_time_total', 'self_cuda_time_total'):
        if hasattr(evt, attr):
            return float(getattr(evt, attr))
    return 0.0


def kernel_events(prof, on_cuda: bool) -> list[tuple[str, int, float]]:
    """(name, calls, total us) of every device kernel (CPU ops by self time in a CPU run), longest first."""
    rows = []
    for evt in prof.key_averages():
        if evt.key.startswith(PHASE):  # the engine's phase ranges, not kernels (their GPU-side spans too)
            continue
        if on_cuda:
            if evt.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = device_time_us(evt)
        else:
            us = float(evt.self_cpu_time_total)
        if us > 0:
            rows.append((evt.key, evt.count, us))
    return sorted(rows, key=lambda r: -r[2])


def by_category(rows: list[tuple[str, int, float]]) -> dict[str, float]:
    """Total us per category, longest first."""
    out: dict[str, float] = defaultdict(float)
    for name, _, us in rows:
        out[category(name)] += us
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def print_breakdown(rows: list[tuple[str, int, float]], wall_ms: float, top: int, steps: int = 1) -> None:
    """The top kernels and the categories against `wall_ms`; `steps` > 1 adds each one's ms per step."""
    per = f' {"ms/step":>8s}' if steps > 1 else ''

    def col(us: float) -> str:
        return f' {us / 1e3 / steps:8.3f}' if steps > 1 else ''
    busy_ms = sum(us for _, _, us in rows) / 1e3
    print(f'\nprofiled wall {wall_ms:.1f} ms, device kernels {busy_ms:.1f} ms ({100 * busy_ms / wall_ms:.1f}% busy)')
    print(f'\n{"kernel":80s} {"calls":>6s} {"total ms":>9s}{per} {"% wall":>7s}  category')
    for name, calls, us in rows[:top]:
        print(f'{name[:80]:80s} {calls:6d} {us / 1e3:9.2f}{col(us)} {100 * us / 1e3 / wall_ms:6.1f}%  {category(name)}')
    print(f'\n{"category":24s} {"total ms":>9s}{per} {"% wall":>7s}')
    for cat, us in by_category(rows).items():
        print(f'{cat:24s} {us / 1e3:9.2f}{col(us)} {100 * us / 1e3 / wall_ms:6.1f}%')


def print_host_ops(prof, top: int) -> None:
    """The `top` host ops (CPU side: Python-level ops and CUDA runtime calls) by self time."""
    rows = sorted(((e.key, e.count, float(e.self_cpu_time_total)) for e in prof.key_averages()
                   if e.device_type == torch.autograd.DeviceType.CPU), key=lambda r: -r[2])
    print(f'\n{"host op":80s} {"calls":>6s} {"self ms":>9s}')
    for name, calls, us in rows[:top]:
        print(f'{name[:80]:80s} {calls:6d} {us / 1e3:9.2f}')


def device_intervals(prof, on_cuda: bool) -> list[tuple[float, float]]:
    """(start, end) us of every device activity record (kernels, memcpy, memset; CPU ops in a CPU run)."""
    out = []
    for evt in prof.events():
        is_device = evt.device_type == torch.autograd.DeviceType.CUDA
        if is_device == on_cuda and evt.time_range.end > evt.time_range.start and not evt.name.startswith(PHASE):
            out.append((float(evt.time_range.start), float(evt.time_range.end)))
    return out


def idle_gaps(intervals: list[tuple[float, float]]) -> tuple[float, float, list[float]]:
    """(span, busy, gaps) in us: the span from the first start to the last end, the time covered by at least one
    interval (overlaps counted once), and the idle gaps between the merged intervals, in timeline order."""
    if not intervals:
        return 0.0, 0.0, []
    gaps, busy = [], 0.0
    ordered = sorted(intervals)
    cur_start, cur_end = ordered[0]
    for start, end in ordered[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            gaps.append(start - cur_end)
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    return cur_end - ordered[0][0], busy, gaps


def print_timeline(prof, on_cuda: bool, wall_ms: float, top: int) -> None:
    """The device's timeline of the profiled window: its span (first activity to last), the busy time inside it,
    and the `top` longest idle gaps with the activities on either side (a graph's internal bubbles, a wait on the
    host, a synchronisation)."""
    events = sorted(((float(e.time_range.start), float(e.time_range.end), e.name) for e in prof.events()
                     if (e.device_type == torch.autograd.DeviceType.CUDA) == on_cuda
                     and e.time_range.end > e.time_range.start and not e.name.startswith(PHASE)), key=lambda e: e[0])
    if not events:
        print('\nno device activity recorded')
        return
    span_us, busy_us, _ = idle_gaps([(a, b) for a, b, _ in events])
    gaps, end, last = [], events[0][1], events[0][2]
    for start, stop, name in events[1:]:
        if start > end:
            gaps.append((start - end, last, name))
        if stop > end:
            end, last = stop, name
    gaps.sort(key=lambda g: -g[0])
    print(f'\ndevice span {span_us / 1e3:.2f} ms of the {wall_ms:.1f} ms wall, busy {busy_us / 1e3:.2f} ms, '
          f'idle inside the span {(span_us - busy_us) / 1e3:.2f} ms in {len(gaps)} gaps')
    for gap, before, after in gaps[:top]:
        print(f'  gap {gap:9.1f} us  after {before[:50]:50s}  before {after[:50]}')


def busy_within(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """us of [start, end] covered by at least one of the (start, end) intervals."""
    clipped = [(max(a, start), min(b, end)) for a, b in intervals if b > start and a < end]
    return idle_gaps(clipped)[1]


def print_phases(prof, on_cuda: bool) -> None:
    """The engine's named host phases (`engine/trace.phase`, `lmdeploy.*` ranges) in timeline order: start and end
    (ms after the window's first record), host duration, and how much of that stretch the device was busy (a phase
    the device idles through is host time on the critical path)."""
    records = [e for e in prof.events() if e.time_range.end > e.time_range.start]
    if not records:
        return
    origin = min(float(e.time_range.start) for e in records)
    device = device_intervals(prof, on_cuda)
    phases = sorted((float(e.time_range.start), float(e.time_range.end), e.name[len(PHASE):]) for e in records
                    if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith(PHASE))
    if device:
        print(f'\ndevice activity from {(min(a for a, _ in device) - origin) / 1e3:.2f} to '
              f'{(max(b for _, b in device) - origin) / 1e3:.2f} ms')
    print(f'\n{"host phase":14s} {"from ms":>8s} {"to ms":>8s} {"host ms":>8s} {"device busy ms":>15s}')
    for start, end, name in phases:
        print(f'{name:14s} {(start - origin) / 1e3:8.2f} {(end - origin) / 1e3:8.2f} {(end - start) / 1e3:8.2f} '
              f'{busy_within(device, start, end) / 1e3:15.2f}')
