"""The markdown report of `bench_real_depth.py`: one row per figure with transformers and the device floor beside it
(and how the floor was computed), and every "Done when" target of issue #18 as met / MISSED with the margin.

Targets sit on the row sizes by position, so a run at other sizes (the smoke run) still evaluates them: cold "1K" is
the first cold size, "8K" the second, "32K" the last; decode "batch 1" the first batch, "batch 128" the last.
"""
from __future__ import annotations

import datetime
import os
import subprocess
from dataclasses import dataclass

TARGETS = dict(suffix_vs_hf=5.0, suffix_vs_floor=3.0, cold_1k_vs_floor=1.5, cold_32k_vs_hf=1.3, pc_on_off=1.05,
               decode_b1_share=0.8, decode_bmax_share=0.5, busy_share=0.9, first_vs_later=1.2)


@dataclass(frozen=True)
class Check:
    """`value op bound` (op '<=' or '>='); value None: not measured."""
    label: str
    value: float | None
    op: str
    bound: float

    def verdict(self) -> str:
        if self.value is None:
            return f'n/a ({self.label})'
        ok = self.value <= self.bound if self.op == '<=' else self.value >= self.bound
        text = f'{self.label} {self.value:.2f} {self.op} {self.bound:g}'
        if ok:
            return f'met ({text})'
        off = self.value / self.bound if self.op == '<=' else self.bound / self.value
        return f'MISSED ({text}: {off:.2f}x off)'

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        return self.value <= self.bound if self.op == '<=' else self.value >= self.bound


@dataclass(frozen=True)
class Row:
    metric: str
    engine: str
    hf: str
    floor: str
    floor_how: str
    vs_hf: str
    vs_floor: str
    checks: tuple[Check, ...] = ()


def _v(results: dict, key: str, name: str) -> float | None:
    v = results.get(key, {}).get(name)
    return float(v) if isinstance(v, int | float) else None


def _f(v: float | None, digits: int = 1, unit: str = '') -> str:
    return 'n/a' if v is None else f'{v:.{digits}f}{unit}'


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _how_prefill(cost, rates, tokens: int, cached: int) -> tuple[float, str]:
    flops, bytes_ = cost.prefill_flops(tokens, cached), cost.prefill_bytes(tokens, cached)
    t = rates.time_s(flops, bytes_)
    sequential = rates.sequential_time_s(cost.prefill_phases(tokens, cached))
    return t * 1e3, (f'max({flops / 1e12:.2f} TFLOP / {rates.matmul_flops_per_s / 1e12:.0f} TFLOP/s, '
                     f'{bytes_ / 1e9:.2f} GB / {rates.copy_bytes_per_s / 1e9:.0f} GB/s); '
                     f'phases in sequence {sequential * 1e3:.2f}')


def _how_decode(cost, rates, batch: int, context: int, weights_only: bool) -> tuple[float, str]:
    bytes_ = cost.decode_bytes(batch, context, weights_only)
    flops = 2.0 * cost.active_matmul_params() * batch
    t = rates.time_s(flops, bytes_)
    what = 'weights' if weights_only else f'weights+KV({context} tok)+state'
    return batch / t, f'{batch} / max({bytes_ / 1e9:.2f} GB {what} / BW, {flops / 1e12:.3f} TFLOP / mm rate)'


def startup_rows(b) -> list[Row]:
    r = b.results.get('engine.startup', {})
    if not r:
        return []
    first, later = _v(b.results, 'engine.startup', 'first_ms'), _v(b.results, 'engine.startup', 'later_ms')
    ratio = _div(first, later)
    second = _v(b.results, 'engine_pc_off.startup', 'startup_s')
    return [Row('engine start-up (s): prefix caching on (off)',
                f'{_f(r.get("startup_s"))} ({_f(second)})', '', '', '', '', ''),
            Row(f'first request after start-up vs a later one (faster of two), {r.get("prompt_len")}-tok prompt + '
                f'{r.get("new_tokens")} tok (ms)', f'{_f(first)} / {_f(later)}', '', '', '', '',
                '', (Check('first/later', ratio, '<=', TARGETS['first_vs_later']),))]


def suffix_rows(b) -> list[Row]:
    rows, a, res = [], b.args, b.results
    for n in a.prefix_sizes:
        eng, hf = _v(res, f'engine_pc_on.suffix.{n}', 'ttft_ms'), _v(res, f'hf.suffix.{n}', 'ttft_ms')
        floor, how = _how_prefill(b.cost, b.rates, a.suffix_len, n)
        cached = res.get(f'engine_pc_on.suffix.{n}', {}).get('num_cached')
        hit = f', cached {min(cached)}' if cached else ''
        speed, share = _div(hf, eng), _div(eng, floor)
        rows.append(Row(f'TTFT {a.suffix_len}-tok suffix after cached {n}-tok prefix (ms){hit}', _f(eng), _f(hf),
                        _f(floor, 2), how, _f(speed, 2, 'x'), _f(share, 2, 'x'),
                        (Check('hf/engine', speed, '>=', TARGETS['suffix_vs_hf']),
                         Check('engine/floor', share, '<=', TARGETS['suffix_vs_floor']))))
    return rows


def cold_rows(b) -> list[Row]:
    rows, a, res = [], b.args, b.results
    sizes = a.cold_sizes
    for i, n in enumerate(sizes):
        off, on = _v(res, f'engine_pc_off.cold.{n}', 'ttft_ms'), _v(res, f'engine_pc_on.cold.{n}', 'ttft_ms')
        hf = _v(res, f'hf.cold.{n}', 'ttft_ms')
        floor, how = _how_prefill(b.cost, b.rates, n, 0)
        checks_off = []
        if i == 0:
            checks_off.append(Check('engine/floor', _div(off, floor), '<=', TARGETS['cold_1k_vs_floor']))
        if i == len(sizes) - 1:
            checks_off.append(Check('hf/engine', _div(hf, off), '>=', TARGETS['cold_32k_vs_hf']))
        rows.append(Row(f'cold TTFT {n} tok, prefix cache off (ms)', _f(off), _f(hf), _f(floor, 2), how,
                        _f(_div(hf, off), 2, 'x'), _f(_div(off, floor), 2, 'x'), tuple(checks_off)))
        checks_on = (Check('on/off', _div(on, off), '<=', TARGETS['pc_on_off']),) if i < 2 else ()
        rows.append(Row(f'cold TTFT {n} tok, prefix cache on (ms)', _f(on), _f(hf), _f(floor, 2), how,
                        _f(_div(hf, on), 2, 'x'), _f(_div(on, floor), 2, 'x'), checks_on))
    return rows


def decode_rows(b) -> list[Row]:
    rows, a, res = [], b.args, b.results
    context = a.decode_prompt_len + 2 + a.decode_steps // 2
    batches = a.decode_batches
    for i, batch in enumerate(batches):
        eng, hf = _v(res, f'engine.decode.{batch}', 'decode_tok_s'), _v(res, f'hf.decode.{batch}', 'decode_tok_s')
        w_floor, w_how = _how_decode(b.cost, b.rates, batch, context, True)
        all_floor, all_how = _how_decode(b.cost, b.rates, batch, context, False)
        checks = []
        if i == 0:
            checks.append(Check('engine/roofline(weights)', _div(eng, w_floor), '>=', TARGETS['decode_b1_share']))
        if i == len(batches) - 1 and i > 0:
            checks.append(Check('engine/roofline(all)', _div(eng, all_floor), '>=', TARGETS['decode_bmax_share']))
        rows.append(Row(f'decode tok/s, batch {batch} (prefill excluded)', _f(eng), _f(hf),
                        f'{_f(w_floor)} (weights) / {_f(all_floor)} (all)', f'{w_how}; {all_how}',
                        _f(_div(eng, hf), 2, 'x'), f'{_f(_div(eng, w_floor), 2)} / {_f(_div(eng, all_floor), 2)}',
                        tuple(checks)))
        sync = _v(res, f'engine_sync.decode.{batch}', 'decode_tok_s')
        if sync is not None:
            shares = f'{_f(_div(sync, w_floor), 2)} / {_f(_div(sync, all_floor), 2)}'
            rows.append(Row(f'decode tok/s, batch {batch}, async scheduling off', _f(sync), _f(hf), '', '',
                            _f(_div(sync, hf), 2, 'x'), shares))
    return rows


def cb_rows(b) -> list[Row]:
    return _cb_rows(b, 'engine.cb', '') + _cb_rows(b, 'engine_sync.cb', ', async scheduling off')


def _cb_rows(b, key: str, label: str) -> list[Row]:
    r = b.results.get(key)
    if not r or 'wall_s' not in r:
        return []
    pct = lambda d: '/'.join(_f(d.get(k), 1) for k in ('p50', 'p90', 'p99'))  # noqa: E731
    busy = r.get('busy_share')
    how = ('CUPTI kernel/memcpy/memset intervals unioned / wall' if b.device == 'cuda'
           else 'CPU op intervals (smoke)') + f'; {r["device_events"]} events spanning {_f(r.get("event_span_s"), 2)} s'
    a = b.args
    desc = (f'{r["num_requests"]} req, prompts {a.cb_prompt_len[0]}-{a.cb_prompt_len[1]}, outputs '
            f'{a.cb_output_len[0]}-{a.cb_output_len[1]}, Poisson {a.cb_rate:g} req/s')
    return [
        Row(f'continuous batching{label} ({desc}): output tok/s (total tok/s, req/s)',
            f'{_f(r["output_tok_s"])} ({_f(r["total_tok_s"])}, {_f(r["req_s"], 2)})', '', '', '', '', ''),
        Row(f'continuous batching{label}: TTFT p50/p90/p99 (ms, from arrival)', pct(r['ttft_ms']), '', '', '', '', ''),
        Row(f'continuous batching{label}: ITL p50/p90/p99 (ms)', pct(r['itl_ms']), '', '', '', '', ''),
        Row(f'continuous batching{label}: device busy share of wall {_f(r["wall_s"])} s (share while work was queued)',
            f'{_f(busy, 3)} ({_f(r.get("busy_share_with_work"), 3)})', '', '', how, '', '',
            (Check('busy', busy, '>=', TARGETS['busy_share']),)),
    ]


def _commit() -> str:
    """$LMDEPLOY_COMMIT where the runner sets it (a copied checkout's git metadata may be stale), else git."""
    if os.environ.get('LMDEPLOY_COMMIT'):
        return os.environ['LMDEPLOY_COMMIT']
    try:
        return subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True,
                              timeout=10).stdout.strip() or 'unknown'
    except (OSError, subprocess.SubprocessError):
        return 'unknown'


def header(b) -> list[str]:
    a, s, c, rates = b.args, b.shape_info, b.cost, b.rates
    lines = [f'# Real-depth benchmark: {s.get("shape")} ({"smoke, " if a.smoke else ""}{b.device}, {a.dtype})', '',
             f'- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; commit: {_commit()}; '
             'env: ' + ', '.join(f'{k}={v}' for k, v in b.env.items())]
    if c is not None:
        experts = (f'{s["experts"]} experts kept of {s["release_experts"]} (top-{s["top_k"]})'
                   if s.get('release_experts') else 'dense MLP')
        lines.append(f'- model: `{s["config_class"]}()` defaults, {s["layers"]} layers ({c.num_full_layers} attention, '
                     f'{c.num_linear_layers} gated DeltaNet), hidden {s["hidden"]}, {experts}, vocab {s["vocab"]}; '
                     f'{c.total_params / 1e9:.3g}B params ({c.total_params * c.weight_bytes / 2**30:.3g} GiB), '
                     f'{c.active_matmul_params() / 1e9:.3g}B active matmul params per token; KV '
                     f'{c.kv_bytes_per_token / 1024:.3g} KiB/token, state {c.state_bytes_per_seq / 2**20:.3g} MiB/seq')
    lines.append(f'- engine: load_format dummy, block {a.block_size}, cache_max_entry_count {a.cache_max_entry_count}, '
                 f'max_batch_size {a.max_batch_size}, max_prefill_token_num {a.max_prefill_token_num}, session_len '
                 f'{a.session_len}; TTFT median of {a.reps} after one untimed; decode over {a.decode_steps} steps '
                 f'after {a.decode_prompt_len}-tok prompts')
    if rates is not None:
        lines.append(f'- device: copy {rates.copy_bytes_per_s / 1e9:.0f} GB/s, {a.dtype} matmul '
                     f'{rates.matmul_flops_per_s / 1e12:.1f} TFLOP/s ({rates.how})')
    lines.append('- floors (benchmark/real_depth_floors.py): prefill = max(FLOPs / matmul rate, bytes / copy rate), '
                 'FLOPs = 2 x active params x tokens + one token of logits + attention + gated delta rule ("phases '
                 'in sequence": the sum of the own floors of the routed experts, dense projections, LM head, '
                 'attention and rule, what kernels each at its floor reach without overlapping phases); decode '
                 'roofline = batch / (bytes per step / copy rate): "weights" = the weights a step reads (experts the '
                 'batch touches), "all" = + KV read + state read and written. "engine vs floor": TTFT / floor '
                 'time (1.00 = at the floor); decode: share of the roofline, weights / all')
    return lines


def render_report(b) -> str:
    lines = header(b) + ['', '| row | engine | transformers | floor | floor from | engine vs transformers | '
                         'engine vs floor | target (issue #18) |', '|---|---:|---:|---:|---|---:|---:|---|']
    rows = startup_rows(b) + suffix_rows(b) + cold_rows(b) + decode_rows(b) + cb_rows(b) if b.cost and b.rates else []
    for row in rows:
        target = '; '.join(c.verdict() for c in row.checks)
        lines.append(f'| {row.metric} | {row.engine} | {row.hf} | {row.floor} | {row.floor_how} | {row.vs_hf} | '
                     f'{row.vs_floor} | {target} |')
    checks = [c for row in rows for c in row.checks]
    met = sum(c.met is True for c in checks)
    missed = sum(c.met is False for c in checks)
    lines += ['', f'targets: {met} met, {missed} missed, {len(checks) - met - missed} not measured']
    lines += b.problem_lines()
    if 'busy_error' in b.results.get('engine.cb', {}):
        lines += ['', f'busy share not measured: {b.results["engine.cb"]["busy_error"]}']
    return '\n'.join(lines)
