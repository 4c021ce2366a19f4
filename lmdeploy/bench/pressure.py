"""The pressure axis of the prefix-cache benchmark: pools sized as a share of each workload's working set.

A busy server's cache is always full, so a cache that only works with room to spare does not work. Per workload
the bench first runs unbounded (a KV pool far larger than the trace and a state budget of several rows per
request). The peak of what that run held is the *working set*: KV blocks in use (requests, trie and frozen blocks)
and live checkpoints. Then every pressure mode runs again with both pools at each pressure level (1.0, 0.5, 0.25
of the working set):
- `full`, the engine's default;
- `full-lru`, with plain LRU eviction;
- `full-aligned`, with checkpoints at block multiples only;
- `aligned`, which also has the checkpoint policies off (the bench's base aligned mode).

Every run uses `max_batch_size = concurrency`, so idle runtime state rows do not quietly enlarge the checkpoint
pool. The KV pool never drops below what the concurrent requests need to run.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

PRESSURE_MODES = ('full', 'full-lru', 'full-aligned', 'aligned')
# Done-when of the pressure axis: the shared-system-prompt workload keeps this share of its unbounded hit rate at
# the lowest pressure level.
SHARED_SYSTEM_FLOOR = 0.9


@dataclass(frozen=True)
class Pools:
    num_blocks: int
    state_budget: int
    max_batch_size: int


@dataclass(frozen=True)
class WorkingSet:
    kv_blocks: int     # peak KV blocks in use in the unbounded run
    checkpoints: int   # peak live checkpoints in the unbounded run
    min_blocks: int    # what `concurrency` requests of the longest prompt + output need at once


def parse_pressures(value: str) -> tuple[float, ...]:
    """'100,50,25' (percent of the working set) -> (1.0, 0.5, 0.25); '' -> () (no pressure axis)."""
    levels = tuple(float(v) / 100 for v in value.split(',') if v.strip())
    if any(not 0 < p <= 1 for p in levels):
        raise ValueError(f'pressure levels are percentages in (0, 100], got {value!r}')
    return levels


def unbounded_pools(num_blocks: int, num_requests: int, concurrency: int) -> Pools:
    return Pools(num_blocks, 4 * num_requests + 16, concurrency)


def working_set(peak_blocks: int, peak_checkpoints: int, longest_request: int, block_size: int,
                concurrency: int) -> WorkingSet:
    per_request = -(-longest_request // block_size) + 1  # + a frozen block for its partial checkpoint
    return WorkingSet(peak_blocks, peak_checkpoints, concurrency * per_request + 1)


def pools_at(ws: WorkingSet, pressure: float, concurrency: int) -> Pools:
    return Pools(max(ws.min_blocks, math.ceil(pressure * ws.kv_blocks)),
                 max(1, math.ceil(pressure * ws.checkpoints)), concurrency)


def label(pressure: float | None) -> str:
    return 'unbounded' if pressure is None else f'{pressure:.0%}'


def pressure_verdicts(results: Sequence) -> list[tuple[str, bool]]:
    """(statement, holds) per check: at every (workload, level) `full` reuses at least as many tokens as every
    other pressure mode; `shared_system` at the lowest level keeps 90% of its unbounded hit rate."""
    by_key = {(r.workload, r.pressure, r.mode): r for r in results}
    levels = sorted({r.pressure for r in results if r.pressure is not None}, reverse=True)
    out = []
    for workload in dict.fromkeys(r.workload for r in results):
        for p in levels:
            full = by_key.get((workload, p, 'full'))
            for other in PRESSURE_MODES[1:]:
                run = by_key.get((workload, p, other))
                if full is not None and run is not None:
                    out.append((f'{workload} at {label(p)}: full reuses {full.cached_tokens} tokens >= {other} '
                                f'{run.cached_tokens}', full.cached_tokens >= run.cached_tokens))
        unbounded = by_key.get((workload, None, 'full'))
        lowest = by_key.get((workload, levels[-1], 'full')) if levels else None
        if workload == 'shared_system' and unbounded is not None and lowest is not None:
            keep = lowest.hit_rate / unbounded.hit_rate if unbounded.hit_rate else 0.0
            out.append((f'shared_system at {label(levels[-1])}: hit rate {lowest.hit_rate:.3f} is {keep:.1%} of the '
                        f'unbounded {unbounded.hit_rate:.3f} (>= {SHARED_SYSTEM_FLOOR:.0%})',
                        keep >= SHARED_SYSTEM_FLOOR))
    return out


_COLUMNS = ('workload', 'pools', 'mode', 'KV blocks', 'ckpt rows', 'hit rate', 'of unbounded', 'oracle',
            'evicted: kv / kv_leaf / state', 'evicted blocks')


def format_pressure_table(results: Sequence) -> str:
    unbounded = {r.workload: r for r in results if r.pressure is None and r.mode == 'full'}
    lines = ['| ' + ' | '.join(_COLUMNS) + ' |', '|' + '---|' * len(_COLUMNS)]
    for r in results:
        if r.pressure is None and r.mode != 'full':
            continue
        ref = unbounded.get(r.workload)
        causes = r.evictions_by_cause
        lines.append('| ' + ' | '.join([
            r.workload, label(r.pressure), r.mode, str(r.num_blocks), str(r.checkpoint_rows), f'{r.hit_rate:.3f}',
            f'{r.hit_rate / ref.hit_rate:.1%}' if ref is not None and ref.hit_rate else '-',
            f'{r.oracle_hit_rate:.3f}',
            f"{causes.get('kv', 0)} / {causes.get('kv_leaf', 0)} / {causes.get('state', 0)}",
            str(r.evicted_blocks)]) + ' |')
    return '\n'.join(lines)


def format_pressure_verdicts(results: Sequence) -> str:
    return '\n'.join(f"- {'ok' if holds else 'FAILS'}: {text}" for text, holds in pressure_verdicts(results))


def plot_pressure(results: Sequence, path: str) -> None:
    """One panel per workload: hit rate against pool size (unbounded, then each level) for each pressure mode,
    the oracle dashed. Lines with markers, no value labels; the legend sits inside the first panel."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r.workload for r in results))
    levels = [None] + sorted({r.pressure for r in results if r.pressure is not None}, reverse=True)
    cols = min(3, len(workloads))
    rows = -(-len(workloads) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False, sharey=True)
    for ax, workload in zip(axes.flat, workloads):
        for mode, marker in zip(PRESSURE_MODES, 'os^v'):
            xs, ys = [], []
            for x, p in enumerate(levels):
                run = next((r for r in results if r.workload == workload and r.pressure == p and r.mode == mode),
                           None)
                if run is not None:
                    xs.append(x)
                    ys.append(run.hit_rate)
            ax.plot(xs, ys, marker=marker, label=mode)
        oracle = max(r.oracle_hit_rate for r in results if r.workload == workload)
        ax.axhline(oracle, color='black', linestyle='--', linewidth=1, label='oracle')
        ax.set_xticks(range(len(levels)), [label(p) for p in levels])
        ax.set_title(workload, fontsize='medium')
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(workloads):]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel('token hit rate')
    axes.flat[0].legend(loc='lower left', fontsize='small', framealpha=0.9)
    fig.suptitle('Prefix-cache hit rate with pools at a share of the working set')
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
