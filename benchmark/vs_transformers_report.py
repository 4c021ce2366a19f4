"""The report of `bench_vs_transformers.py`: one row per metric (engine, transformers, the engine's speedup, the
target and whether it is met), the greedy first-token agreement, and the markdown page around them."""
from __future__ import annotations

from bench_harness import Bench

TARGET_DECODE = {1: 10.0, 64: 5.0}  # engine / transformers decode tok/s
TARGET_SUFFIX = 3.0  # transformers / engine suffix TTFT
TARGET_PC_OVERHEAD = 1.05  # engine cold TTFT, prefix caching on / off


def _val(results: dict, key: str, field_: str) -> float | None:
    v = results.get(key, {}).get(field_)
    return float(v) if isinstance(v, int | float) else None


def _fmt(v: float | None, digits: int = 1) -> str:
    return 'n/a' if v is None else f'{v:.{digits}f}'


def _fmt_x(v: float | None) -> str:
    return 'n/a' if v is None else f'{v:.2f}x'


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def _met(ok: bool | None) -> str:
    return 'n/a' if ok is None else ('yes' if ok else 'NO')


def build_rows(bench: Bench) -> list[dict]:
    """One row per metric: engine, transformers, speedup of the engine (higher is better), target, met."""
    r, a = bench.results, bench.args
    rows = []
    for n in a.cold_sizes:
        off, on, hf = (_val(r, f'{k}.cold.{n}', 'ttft_ms') for k in ('engine_pc_off', 'engine_pc_on', 'hf'))
        rows.append(dict(metric=f'cold TTFT {n} tok, prefix cache off (ms)', engine=off, transformers=hf,
                         speedup=_ratio(hf, off), target='', met=None))
        on_off = _ratio(on, off)
        rows.append(dict(metric=f'cold TTFT {n} tok, prefix cache on (ms)', engine=on, transformers=hf,
                         speedup=_ratio(hf, on), target=f'on/off {_fmt(on_off, 3)} <= {TARGET_PC_OVERHEAD}',
                         met=None if on_off is None else on_off <= TARGET_PC_OVERHEAD))
    for n in a.prefix_sizes:
        eng, hf = _val(r, f'engine_pc_on.suffix.{n}', 'ttft_ms'), _val(r, f'hf.suffix.{n}', 'ttft_ms')
        cached = r.get(f'engine_pc_on.suffix.{n}', {}).get('num_cached')
        sp = _ratio(hf, eng)
        hit = f', cached {min(cached)}' if cached else ''
        rows.append(dict(metric=f'TTFT {a.suffix_len}-tok suffix after cached {n}-tok prefix (ms){hit}', engine=eng,
                         transformers=hf, speedup=sp, target=f'>= {TARGET_SUFFIX}x',
                         met=None if sp is None else sp >= TARGET_SUFFIX))
    for b in a.decode_batches:
        eng, hf = _val(r, f'engine_pc_off.decode.{b}', 'decode_tok_s'), _val(r, f'hf.decode.{b}', 'decode_tok_s')
        sp = _ratio(eng, hf)
        tgt = TARGET_DECODE.get(b)
        rows.append(dict(metric=f'decode tok/s, batch {b} (decode only)', engine=eng, transformers=hf, speedup=sp,
                         target=f'>= {tgt}x' if tgt else '', met=None if tgt is None or sp is None else sp >= tgt))
    for b in a.decode_batches:
        eng, hf = _val(r, f'engine_pc_off.decode.{b}', 'overall_tok_s'), _val(r, f'hf.decode.{b}', 'overall_tok_s')
        rows.append(dict(metric=f'tok/s, batch {b} (overall, incl. prefill)', engine=eng, transformers=hf,
                         speedup=_ratio(eng, hf), target='', met=None))
    return rows


def first_token_agreement(bench: Bench) -> tuple[int, int]:
    """Greedy first tokens of the same prompts, engine vs transformers (info: bf16 near-ties differ)."""
    same = total = 0
    for key, res in bench.results.items():
        if not key.startswith('hf.'):
            continue
        kind, size = key.split('.')[1:]
        for tag in ('engine_pc_off', 'engine_pc_on'):
            eng = bench.results.get(f'{tag}.{kind}.{size}', {}).get('first_tokens')
            hf = res.get('first_tokens')
            if eng and hf and len(eng) == len(hf):
                same += sum(int(x == y) for x, y in zip(eng, hf))
                total += len(hf)
    return same, total


def render_markdown(bench: Bench) -> str:
    a = bench.args
    lines = [f'# lmdeploy engine vs transformers ({"smoke, " if a.smoke else ""}{bench.device}, {a.dtype})', '',
             'env: ' + ', '.join(f'{k}={v}' for k, v in bench.env.items()), '',
             f'engine: block_size {a.block_size}, cache_max_entry_count {a.cache_max_entry_count}, max_batch_size '
             f'{a.max_batch_size}, max_prefill_token_num {a.max_prefill_token_num}, session_len {a.session_len}; '
             f'median of {a.reps} (decode: {a.decode_reps}); decode prompts {a.decode_prompt_len} tok, '
             f'{a.decode_new_tokens} new tok', '',
             '| metric | engine | transformers | engine speedup | target | met |',
             '|---|---:|---:|---:|---|---|']
    for row in build_rows(bench):
        lines.append(f'| {row["metric"]} | {_fmt(row["engine"])} | {_fmt(row["transformers"])} | '
                     f'{_fmt_x(row["speedup"])} | {row["target"]} | {_met(row["met"])} |')
    same, total = first_token_agreement(bench)
    lines += ['', f'greedy first-token agreement engine vs transformers on the same prompts: {same}/{total} '
              '(info only: bf16 near-ties differ between implementations)']
    lines += bench.problem_lines()
    checks = {k: v['cache_matches_full_forward'] for k, v in bench.results.items()
              if 'cache_matches_full_forward' in v}
    if checks:
        lines += ['', f'transformers cached-suffix token == full-forward token: {checks}']
    return '\n'.join(lines)
