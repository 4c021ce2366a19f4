"""`benchmark/bench_real_depth.py`: the floors' parameter counts against transformers' models, the statistics
against numpy, the target verdicts, and one `--smoke` run (tiny float32 MoE shape on the CPU; no speed asserted)."""
from __future__ import annotations

import sys

import pytest
from bench_scripts import bench_script

pytest.importorskip('transformers')


@pytest.fixture(scope='module')
def bench():
    with bench_script('bench_real_depth') as module:
        yield module


@pytest.mark.parametrize('shape', ['qwen3.5-9b', 'qwen3.5-35b-a3b', 'qwen3-next-80b'])
def test_floor_parameter_count_equals_the_transformers_model(bench, shape):
    args = bench.parse_args(['--smoke', '--shape', shape])
    config, model_name, _ = bench.make_config(args)
    model = bench.build_hf_model(config, model_name, 'cpu', __import__('torch').float32)
    cost = sys.modules['real_depth_floors'].model_cost(config, weight_bytes=4)
    assert cost.total_params == sum(p.numel() for p in model.parameters())
    assert cost.num_full_layers + cost.num_linear_layers == config.num_hidden_layers


def test_real_shapes_keep_release_depth_and_widths(bench):
    floors = sys.modules['real_depth_floors']
    for shape, layers, hidden in (('qwen3.5-9b', 32, 4096), ('qwen3.5-35b-a3b', 40, 2048),
                                  ('qwen3-next-80b', 48, 2048)):
        config, _, release = bench.make_config(bench.parse_args(['--shape', shape, '--experts', '64']))
        assert (config.num_hidden_layers, config.hidden_size) == (layers, hidden)
        cost = floors.model_cost(config)
        if release:
            assert cost.num_experts == 64 and cost.num_moe_layers == layers
            # one token touches exactly top_k experts; a large batch touches (almost) all of them
            assert cost.expected_experts(1) == pytest.approx(cost.top_k)
            assert cost.expected_experts(10_000) == pytest.approx(64)
    dense = floors.model_cost(bench.make_config(bench.parse_args(['--shape', 'qwen3.5-9b']))[0])
    assert 8.5e9 < dense.total_params < 9.5e9
    # decode: KV and state only add bytes; prefill: FLOPs grow faster than linearly (attention)
    assert dense.decode_bytes(128, 640) > dense.decode_bytes(128, 640, weights_only=True)
    assert dense.prefill_flops(2048) > 2 * dense.prefill_flops(1024)


def test_percentiles_match_numpy_and_union_counts_overlaps_once(bench):
    np = pytest.importorskip('numpy')
    serving = sys.modules['real_depth_serving']
    values = [5.0, 1.0, 9.5, 3.25, 7.0, 2.0, 8.0]
    got = serving.percentiles(values)
    for p in (50, 90, 99):
        assert got[f'p{p}'] == pytest.approx(float(np.percentile(values, p)))
    assert serving.union_length([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20
    work = serving.poisson_workload(50, 10.0, (4, 9), (1, 3), vocab=100, seed=1)
    assert work == serving.poisson_workload(50, 10.0, (4, 9), (1, 3), vocab=100, seed=1)
    assert all(4 <= len(p) <= 9 for p in work.prompts) and work.arrivals == sorted(work.arrivals)


def test_checks_say_met_or_by_how_much_missed(bench):
    report = sys.modules['real_depth_report']
    assert report.Check('x', 1.2, '<=', 1.5).verdict() == 'met (x 1.20 <= 1.5)'
    assert report.Check('x', 3.0, '<=', 1.5).verdict() == 'MISSED (x 3.00 <= 1.5: 2.00x off)'
    assert report.Check('y', 2.5, '>=', 5.0).verdict() == 'MISSED (y 2.50 >= 5: 2.00x off)'
    assert report.Check('y', None, '>=', 5.0).met is None


def test_smoke_run_fills_every_row_and_evaluates_every_target(bench, tmp_path):
    out = tmp_path / 'report.md'
    summary = bench.main(['--smoke', '--shape', 'qwen3.5-35b-a3b', '--reps', '1', '--cb-requests', '6',
                          '--out', str(out)])
    results = summary['results']
    assert not {k: v for k, v in results.items() if 'error' in v or 'skipped' in v}
    expected = {'engine.startup', 'engine.cb', 'engine_pc_on.suffix.50', 'hf.suffix.100', 'engine_pc_off.cold.160',
                'engine_pc_on.cold.64', 'hf.cold.64', 'engine.decode.4', 'hf.decode.1'}
    assert expected <= set(results)
    # the suffix rows really hit the cache, and transformers' cached suffix agrees with its full forward
    assert results['engine_pc_on.suffix.100']['num_cached'] == [100]
    assert results['hf.suffix.50']['cache_matches_full_forward'] is True
    assert results['engine.cb']['num_requests'] == 6 and 0 < results['engine.cb']['busy_share'] <= 1
    text = out.read_text()
    # 12 targets: first/later, 2 suffix rows x 2, 1K floor, 32K vs hf, on/off x 2, decode b1 and bmax, busy
    assert 'targets: ' in text and ', 0 not measured' in text
    met, missed = (int(text.split('targets: ')[1].split(' met, ')[0]),
                   int(text.split(' met, ')[1].split(' missed')[0]))
    assert met + missed == 12


def test_isolated_phases_merge_both_engines_rows_into_one_report(bench, tmp_path):
    out = tmp_path / 'report.md'
    summary = bench.main(['--smoke', '--isolate', '--rows', 'cold', '--systems', 'engine', '--cold-sizes', '64',
                          '--reps', '1', '--out', str(out)])
    results = summary['results']
    # each phase ran in its own process; the parent holds both engines' rows and the first phase's device rates
    assert {'engine_pc_on.cold.64', 'engine_pc_off.cold.64'} <= set(results)
    assert not [k for k, v in results.items() if 'error' in v]
    assert 'cold TTFT 64 tok, prefix cache on (ms)' in out.read_text() and 'copy ' in out.read_text()
