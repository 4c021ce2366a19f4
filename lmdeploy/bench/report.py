"""Results of the prefix-cache benchmark: one `RunResult` per (workload, mode), rendered as a markdown table, a
hit-rate plot and a JSON summary. Pure formatting: nothing here touches the engine.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from .oracle import MISS_REASONS
from .pressure import format_pressure_table, format_pressure_verdicts, plot_pressure, pressure_verdicts

# Keys every JSON summary carries at top level (for the last run) and in each entry of `runs`.
SUMMARY_KEYS = ('hit_rate', 'oracle_hit_rate', 'ttft_p50_ms', 'ttft_p95_ms', 'throughput_tok_s',
                'match_ms_per_request')


@dataclass(frozen=True)
class RunResult:
    workload: str
    mode: str
    num_requests: int
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    # Sum of cached tokens / sum of prompt tokens, and the capacity-free oracle's.
    hit_rate: float
    oracle_hit_rate: float
    # Submit -> first streamed token.
    ttft_p50_ms: float
    ttft_p95_ms: float
    # Generated tokens / wall time of the whole trace.
    throughput_tok_s: float
    wall_s: float
    # CPU time inside BlockTrie.match (every call, admission retries included) per request.
    match_ms_per_request: float
    match_calls: int
    # State slots + frozen partial blocks held by checkpoints: peak (sampled at each request end) and at the end.
    checkpoint_mib_peak: float
    checkpoint_mib_final: float
    live_checkpoints: int
    checkpoints_saved: int
    evicted_checkpoints: int
    evicted_blocks: int
    # Missed prompt tokens by reason (see `oracle.py`); `miss_reasons_source` is 'bench' or 'engine'.
    miss_reasons: dict[str, int] = field(default_factory=dict)
    miss_reasons_source: str = 'bench'
    # Digest of every request's generated token ids keyed by (conversation, turn).
    outputs_digest: str = ''
    # Same digest as the first mode of this workload (None until compared, or when it ran alone).
    outputs_match: bool | None = None
    # Generated token ids per request, keyed 'conversation:turn' (for per-request comparison across modes).
    outputs: dict[str, list[int]] = field(default_factory=dict, repr=False)
    # Per request, the top-1 minus top-2 logprob of each generated token (same keys as `outputs`).
    margins: dict[str, list[float]] = field(default_factory=dict, repr=False)
    # Requests whose generated tokens equal the first mode's for the same conversation turn (None: not compared).
    same_requests: int | None = None
    # Where a request's tokens part from the first mode's: the largest, over those requests, of the first mode's
    # top-1 minus top-2 logprob at the parting token (small = the modes parted at a near-tie). None: no parting.
    parting_margin: float | None = None
    # Pressure axis (pressure.py): the share of the working set the pools had (None: unbounded), the pool sizes,
    # checkpoint evictions by cause, and the peaks this run held (the working set when unbounded).
    pressure: float | None = None
    num_blocks: int = 0
    checkpoint_rows: int = 0
    evictions_by_cause: dict[str, int] = field(default_factory=dict)
    peak_kv_blocks: int = 0
    peak_checkpoints: int = 0
    max_request_tokens: int = 0  # the longest prompt + output

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def compare_outputs(results: Sequence[RunResult]) -> list[RunResult]:
    """Mark each run with whether its outputs equal those of the first run of the same workload."""
    reference: dict[str, RunResult] = {}
    counts: dict[str, int] = {}
    for r in results:
        reference.setdefault(r.workload, r)
        counts[r.workload] = counts.get(r.workload, 0) + 1
    out = []
    for r in results:
        if counts[r.workload] == 1:
            out.append(dataclasses.replace(r, outputs_match=None, same_requests=None))
            continue
        ref = reference[r.workload]
        same = sum(ref.outputs.get(key) == ids for key, ids in r.outputs.items()) if r.outputs else None
        out.append(dataclasses.replace(r, outputs_match=r.outputs_digest == ref.outputs_digest, same_requests=same,
                                       parting_margin=_parting_margin(ref, r)))
    return out


def _parting_margin(ref: RunResult, run: RunResult) -> float | None:
    margins = []
    for key, ids in run.outputs.items():
        ref_ids = ref.outputs.get(key)
        if ref_ids is None or ref_ids == ids:
            continue
        i = next((i for i, (a, b) in enumerate(zip(ref_ids, ids)) if a != b), min(len(ids), len(ref_ids)))
        ref_margins = ref.margins.get(key, [])
        margins.append(ref_margins[i] if i < len(ref_margins) else float('nan'))
    return max(margins) if margins else None


def outputs_verdicts(results: Sequence[RunResult]) -> dict[str, bool | None]:
    """Per workload: True when all modes generated identical tokens (None when only one mode ran)."""
    verdicts: dict[str, bool | None] = {}
    for r in results:
        if r.outputs_match is None:
            verdicts.setdefault(r.workload, None)
        else:
            verdicts[r.workload] = bool(verdicts.get(r.workload, True)) and r.outputs_match
    return verdicts


_COLUMNS = ('workload', 'mode', 'reqs', 'prompt tok', 'hit rate', 'oracle', 'of oracle', 'TTFT p50 ms', 'TTFT p95 ms',
            'tok/s', 'match ms/req', 'ckpt MiB peak', 'ckpts', 'evicted ck/blk') \
    + tuple(f'miss {r}' for r in MISS_REASONS) + ('same output',)


def _row(r: RunResult) -> list[str]:
    parted = f', parted at margin <= {r.parting_margin:.2g}' if r.parting_margin is not None else ''
    detail = f' ({r.same_requests}/{r.num_requests} same{parted})' if r.same_requests is not None else ''
    match = {None: '-', True: 'yes', False: f'NO{detail}'}[r.outputs_match]
    misses = [str(r.miss_reasons.get(k, 0)) for k in MISS_REASONS]
    return [r.workload, r.mode, str(r.num_requests), str(r.prompt_tokens), f'{r.hit_rate:.3f}',
            f'{r.oracle_hit_rate:.3f}', f'{r.hit_rate / r.oracle_hit_rate:.1%}' if r.oracle_hit_rate else '-',
            f'{r.ttft_p50_ms:.1f}', f'{r.ttft_p95_ms:.1f}', f'{r.throughput_tok_s:.1f}',
            f'{r.match_ms_per_request:.3f}', f'{r.checkpoint_mib_peak:.2f}', str(r.live_checkpoints),
            f'{r.evicted_checkpoints}/{r.evicted_blocks}', *misses, match]


def format_table(results: Sequence[RunResult]) -> str:
    lines = ['| ' + ' | '.join(_COLUMNS) + ' |', '|' + '---|' * len(_COLUMNS)]
    lines += ['| ' + ' | '.join(_row(r)) + ' |' for r in results]
    return '\n'.join(lines)


def format_verdicts(results: Sequence[RunResult]) -> str:
    words = {None: 'only one mode ran', True: 'identical across modes', False: 'DIFFER between modes'}
    return '\n'.join(f'- outputs of {w}: {words[v]}' for w, v in outputs_verdicts(results).items())


_NOTES = """\
Columns: `hit rate` = cached prompt tokens / prompt tokens; `oracle` = the same for a capacity-free cache that can
resume at any token an earlier request fed to the model (its prompt + output minus the last sampled token, which
is never fed), a whole prompt included (an upper bound); `of oracle` = hit rate / oracle; TTFT = submit to first
streamed token; `tok/s` = generated tokens / wall time; `match ms/req` = CPU time in `BlockTrie.match` per request;
`ckpt MiB peak` = state rows + frozen partial blocks held by checkpoints (peak over request ends); `ckpts` = live
checkpoints at the end; `miss *` = missed prompt tokens by reason (novel: never seen before; no_checkpoint: seen,
but no state checkpoint at a usable step; in_flight: its source was still prefilling; evicted / capacity: see
`lmdeploy/bench/oracle.py`); `same output` = generated tokens equal those of the first mode of the workload; where
they do not, how many requests are identical and the largest top-1 minus top-2 logprob (in the first mode) at a
token where a request parted: a small margin means the modes parted at a near-tie, where float rounding decides."""


def write_markdown(results: Sequence[RunResult], path: str, header: Sequence[str]) -> None:
    with open(path, 'w') as f:
        f.write('# Prefix-cache benchmark\n\n')
        f.writelines(f'- {line}\n' for line in header)
        f.write('\n' + format_table(results) + '\n\n' + format_verdicts(results) + '\n\n' + _NOTES + '\n')
        if has_pressure(results):
            f.write('\n## Under pressure\n\nPools at a share of the working set (peak of the unbounded `full` run); '
                    '`of unbounded` = hit rate / the unbounded `full` hit rate.\n\n' + format_pressure_table(results)
                    + '\n\n' + format_pressure_verdicts(results) + '\n')


def has_pressure(results: Sequence[RunResult]) -> bool:
    return any(r.pressure is not None for r in results)


def plot_hit_rates(results: Sequence[RunResult], path: str) -> None:
    """Grouped bars: hit rate per workload for each mode, with the oracle as a black tick per workload."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r.workload for r in results))
    modes = list(dict.fromkeys(r.mode for r in results))
    width = 0.8 / max(1, len(modes))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(workloads) + 2), 4.0))
    for m, mode in enumerate(modes):
        xs, ys = [], []
        for w, workload in enumerate(workloads):
            run = next((r for r in results if r.workload == workload and r.mode == mode), None)
            if run is not None:
                xs.append(w - 0.4 + width * (m + 0.5))
                ys.append(run.hit_rate)
        bars = ax.bar(xs, ys, width, label=mode)
        # Vertical labels never overlap their neighbours, however many modes share a group.
        ax.bar_label(bars, labels=[f'{y:.2f}' for y in ys], fontsize='x-small', padding=2, rotation=90)
    for w, workload in enumerate(workloads):
        oracle = max(r.oracle_hit_rate for r in results if r.workload == workload)
        ax.hlines(oracle, w - 0.45, w + 0.45, colors='black', linewidth=2, label='oracle' if w == 0 else None)
    ax.set_xticks(range(len(workloads)), workloads)
    # Headroom above 1 (labels reach ~1.12) holds the legend inside the axes, in rows of at most 5 entries.
    ncol = min(5, len(modes) + 1)
    ax.set_ylim(0, 1.2 + 0.09 * -(-(len(modes) + 1) // ncol))
    ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    ax.set_ylabel('token hit rate')
    ax.set_title('Prefix-cache hit rate by workload and checkpoint mode')
    ax.legend(loc='upper center', ncol=ncol, fontsize='small', framealpha=0.9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(results: Sequence[RunResult], out_dir: str, header: Sequence[str]) -> tuple[str, str]:
    """Write `report.md` and `hit_rate.png` into `out_dir`; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    md, png = os.path.join(out_dir, 'report.md'), os.path.join(out_dir, 'hit_rate.png')
    write_markdown(results, md, header)
    plot_hit_rates([r for r in results if r.pressure is None], png)
    if has_pressure(results):
        plot_pressure(results, os.path.join(out_dir, 'pressure.png'))
    return md, png


def summary_json(results: Sequence[RunResult]) -> dict:
    """The last run's summary keys at top level, every run under `runs`, per-workload output verdicts."""
    last = results[-1].to_json()
    summary = {key: last[key] for key in SUMMARY_KEYS}
    summary.update(workload=last['workload'], mode=last['mode'], outputs_match=outputs_verdicts(results),
                   runs=[r.to_json() for r in results],
                   pressure_verdicts=[{'check': text, 'holds': holds} for text, holds in pressure_verdicts(results)])
    return summary
