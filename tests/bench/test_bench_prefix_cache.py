"""`lmdeploy bench prefix-cache`: oracle and workload units, plus one CPU smoke run on the hybrid demo model."""
from __future__ import annotations

import json

import pytest

from lmdeploy.bench import workloads
from lmdeploy.bench.oracle import MISS_REASONS, RequestTiming, attribute_misses, oracle_hits
from lmdeploy.bench.report import SUMMARY_KEYS, RunResult, compare_outputs, format_table


def test_oracle_counts_tokens_earlier_requests_fed_to_the_model():
    prompts = [[1, 2, 3], [1, 2, 3], [1, 2, 3, 9, 5], [7], [1, 2, 3, 9, 8, 6], [1, 2]]
    outputs = [[9, 8], [4], [], [1], [], [5]]
    hits = oracle_hits(prompts, outputs)
    # first request: nothing earlier; an identical prompt: all of it (its last position's logits were computed);
    # request 2 reuses request 0's output token 9. Request 4 also resends request 0's last sampled token 8, which
    # no engine fed to the model: not counted. Request 5 is a prefix of what request 0 fed.
    assert [h.num_tokens for h in hits] == [0, 3, 4, 0, 4, 2]
    assert [h.source for h in hits] == [None, 0, 0, None, 0, 0]


def test_miss_reasons_sum_to_missed_tokens():
    hits = oracle_hits([[1, 2, 3, 4], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6]], [[], [], []])
    timings = [RequestTiming(0.0, 1.0, 0), RequestTiming(2.0, 3.0, 0), RequestTiming(0.5, 4.0, 1)]
    reasons = attribute_misses([4, 5, 6], [0, 2, 0], hits, timings)
    assert set(reasons) == set(MISS_REASONS)
    assert sum(reasons.values()) == (4 + 5 + 6) - 2
    # request 1: 4 seen, 2 served -> 2 missed with no eviction; request 2 submitted before request 0's first token
    assert reasons['no_checkpoint'] == 2 and reasons['in_flight'] == 5 and reasons['novel'] == 4 + 1 + 1


@pytest.mark.parametrize('name', workloads.WORKLOADS + workloads.MULTIMODAL_WORKLOADS)
def test_workload_is_seeded_and_has_exact_request_count(name):
    sizing = workloads.WorkloadSizing(max_prefill_token_num=64, max_prompt_tokens=1000)
    count = lambda text: len(text.split())  # noqa: E731
    a = workloads.build_workload(name, 7, 3, sizing, count)
    assert a == workloads.build_workload(name, 7, 3, sizing, count)
    assert a != workloads.build_workload(name, 7, 4, sizing, count)
    assert a.num_requests == 7


def test_cli_wires_bench_prefix_cache():
    from lmdeploy.bench.prefix_cache import run_cli
    from lmdeploy.cli.entrypoint import build_parser
    args = build_parser().parse_args(['bench', 'prefix-cache', '--mode', 'exact', '--workload', 'repeat'])
    assert args.func is run_cli and args.mode == ('exact',) and args.block_size == 16


def test_cli_takes_workload_lists_pressure_modes_and_dummy_weights():
    from lmdeploy.bench.prefix_cache import BenchConfig
    from lmdeploy.cli.entrypoint import build_parser
    parse = build_parser().parse_args
    args = parse(['bench', 'prefix-cache', '--workload', 'shared_system,all', '--pressure', '50',
                  '--pressure-modes', 'aligned,full-lru', '--load-format', 'dummy', '--eager-mode', '--model', '/m',
                  '--device', 'cpu'])
    config = BenchConfig.from_args(args)
    assert config.workloads == ('shared_system', *(w for w in workloads.WORKLOADS if w != 'shared_system'))
    assert config.pressure_modes == ('full', 'full-lru', 'aligned')   # full always, in the table's order
    engine = config.engine_config('full')
    assert engine.load_format == 'dummy' and engine.eager_mode
    with pytest.raises(SystemExit):
        parse(['bench', 'prefix-cache', '--workload', 'shared_sys'])
    with pytest.raises(SystemExit):
        parse(['bench', 'prefix-cache', '--pressure-modes', 'exact'])


def _run(mode: str, outputs: dict, margins: dict) -> RunResult:
    return RunResult(workload='w', mode=mode, num_requests=len(outputs), prompt_tokens=10, cached_tokens=0,
                     generated_tokens=0, hit_rate=0.0, oracle_hit_rate=0.5, ttft_p50_ms=1.0, ttft_p95_ms=1.0,
                     throughput_tok_s=1.0, wall_s=1.0, match_ms_per_request=0.0, match_calls=0,
                     checkpoint_mib_peak=0.0, checkpoint_mib_final=0.0, live_checkpoints=0, checkpoints_saved=0,
                     evicted_checkpoints=0, evicted_blocks=0, outputs_digest=str(sorted(outputs.items())),
                     outputs=outputs, margins=margins)


def test_compare_outputs_counts_identical_requests_and_the_parting_margin():
    ref = _run('off', {'0:0': [1, 2, 3], '0:1': [4, 5, 6], '1:0': [7, 8]},
               {'0:0': [2.0, 0.5, 1.0], '0:1': [3.0, 0.01, 2.0], '1:0': [1.0, 0.2]})
    same = _run('exact', dict(ref.outputs), {})
    parted = _run('full', {'0:0': [1, 9, 9], '0:1': [4, 5, 6], '1:0': [7, 3]}, {})
    off, exact, full = compare_outputs([ref, same, parted])
    assert off.outputs_match is True and off.same_requests == 3 and off.parting_margin is None
    assert exact.outputs_match is True and exact.same_requests == 3
    # '0:0' parts at token 1 (reference margin 0.5), '1:0' at token 1 (0.2): the largest is reported
    assert full.outputs_match is False and full.same_requests == 1 and full.parting_margin == 0.5
    assert 'NO (1/3 same, parted at margin <= 0.5)' in format_table([full])
    assert compare_outputs([ref])[0].same_requests is None  # one mode: nothing to compare


def test_multi_turn_smoke_exact_beats_aligned_with_identical_outputs(tmp_path, capsys):
    from lmdeploy.bench.__main__ import main  # no benchmark named: defaults to prefix-cache
    out_dir = tmp_path / 'report'
    assert main(['--device', 'cpu', '--workload', 'multi_turn', '--mode', 'all', '--requests', '6',
                 '--max-new-tokens', '6', '--json', '--out', str(out_dir)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(last)
    assert all(key in summary for key in SUMMARY_KEYS)
    runs = {run['mode']: run for run in summary['runs']}
    from lmdeploy.bench.prefix_cache import MODES
    assert set(runs) == set(MODES)
    assert runs['off']['hit_rate'] == 0.0
    assert runs['exact']['hit_rate'] > runs['aligned']['hit_rate']
    # Reply checkpoints reuse the previous turn's reply as well: the full policy set beats bare exact steps.
    assert runs['full']['hit_rate'] > runs['exact']['hit_rate']
    assert all(run['hit_rate'] <= run['oracle_hit_rate'] for run in runs.values())
    assert len({run['outputs_digest'] for run in runs.values()}) == 1
    assert summary['outputs_match'] == {'multi_turn': True}
    assert all(run['same_requests'] == 6 for run in runs.values())
    # greedy top-2 margins come back for every generated token
    assert all(len(m) == 6 and min(m) >= 0 for m in runs['off']['margins'].values())
    assert (out_dir / 'report.md').read_text().count('| multi_turn |') == len(MODES)
    assert (out_dir / 'hit_rate.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_pressure_pools_scale_the_working_set_and_never_starve_running_requests():
    from lmdeploy.bench.pressure import Pools, parse_pressures, pools_at, working_set
    assert parse_pressures('100,50,25') == (1.0, 0.5, 0.25) and parse_pressures('') == ()
    with pytest.raises(ValueError):
        parse_pressures('150')
    # 4 requests of up to 100 tokens at once (block 16): 4 * (7 + 1 frozen) + 1 = 33 blocks at least.
    ws = working_set(peak_blocks=200, peak_checkpoints=40, longest_request=100, block_size=16, concurrency=4)
    assert ws.min_blocks == 33
    assert pools_at(ws, 0.5, 4) == Pools(100, 20, 4)
    assert pools_at(ws, 0.1, 4) == Pools(33, 4, 4)


def test_pressure_verdicts_compare_full_with_every_mode_and_the_shared_system_floor():
    import dataclasses

    from lmdeploy.bench.pressure import pressure_verdicts

    def run(mode, pressure, cached, workload='shared_system'):
        return dataclasses.replace(_run(mode, {}, {}), workload=workload, pressure=pressure, cached_tokens=cached,
                                   hit_rate=cached / 100)

    results = [run('full', None, 80), run('full', 0.25, 70), run('full-lru', 0.25, 75), run('aligned', 0.25, 10)]
    verdicts = pressure_verdicts(results)
    assert [holds for _, holds in verdicts] == [False, True, False]  # 70 < 75; 70 >= 10; 0.70 < 0.9 * 0.80
    assert 'full reuses 70 tokens >= full-lru 75' in verdicts[0][0]


def test_pressure_smoke_writes_the_table_verdicts_and_plot(tmp_path, capsys):
    from lmdeploy.bench.__main__ import main
    out_dir = tmp_path / 'report'
    assert main(['--device', 'cpu', '--workload', 'shared_system', '--mode', 'full', '--requests', '6',
                 '--max-new-tokens', '4', '--pressure', '100,25', '--json', '--out', str(out_dir)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    runs = [(run['mode'], run['pressure']) for run in summary['runs']]
    from lmdeploy.bench.pressure import PRESSURE_MODES
    assert runs == [('full', None)] + [(m, p) for p in (1.0, 0.25) for m in PRESSURE_MODES]
    assert any('shared_system at 25%' in v['check'] and '(>= 90%)' in v['check'] for v in summary['pressure_verdicts'])
    unbounded, at_25 = summary['runs'][0], summary['runs'][-len(PRESSURE_MODES)]
    assert at_25['checkpoint_rows'] < unbounded['checkpoint_rows'] and at_25['num_blocks'] < unbounded['num_blocks']
    assert '## Under pressure' in (out_dir / 'report.md').read_text()
    assert (out_dir / 'pressure.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_multimodal_workloads_resume_after_the_shared_images_with_identical_outputs(tmp_path, capsys, monkeypatch):
    """Shared images + different questions, and multi-turn over one image, on the tiny VL demo model: the cache
    serves most of the oracle's tokens (the last image's end is checkpointed; different images never alias in
    the oracle either: their placeholders become content-hash ids), and every mode generates the same tokens."""
    from lmdeploy.bench.__main__ import main
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path))
    assert main(['--device', 'cpu', '--workload', 'multimodal', '--mode', 'off,full', '--requests', '6',
                 '--max-new-tokens', '4', '--state-budget', '32', '--json']) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    runs = {(run['workload'], run['mode']): run for run in summary['runs']}
    assert summary['outputs_match'] == {'mm_shared_images': True, 'mm_multi_turn': True}
    for name in ('mm_shared_images', 'mm_multi_turn'):
        assert runs[(name, 'off')]['hit_rate'] == 0.0
        full = runs[(name, 'full')]
        assert 0.5 * full['oracle_hit_rate'] < full['hit_rate'] <= full['oracle_hit_rate']
