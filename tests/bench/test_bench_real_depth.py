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


@pytest.mark.parametrize('shape', ['qwen3.5-9b', 'qwen3.5-35b-a3b', 'qwen3-next-80b'])
@pytest.mark.parametrize('tokens,cached', [(1024, 0), (100, 32700), (1, 0)])
def test_prefill_phases_split_the_whole_forward_and_their_floors_add_up_to_at_least_its_floor(bench, shape, tokens,
                                                                                           cached):
    floors = sys.modules['real_depth_floors']
    cost = floors.model_cost(bench.make_config(bench.parse_args(['--shape', shape, '--experts', '64']))[0])
    phases = cost.prefill_phases(tokens, cached)
    assert sum(f for f, _ in phases.values()) == pytest.approx(cost.prefill_flops(tokens, cached))
    assert sum(b for _, b in phases.values()) == pytest.approx(cost.prefill_bytes(tokens, cached))
    assert (phases['experts'] == (0.0, 0.0)) == (shape == 'qwen3.5-9b')
    rates = floors.DeviceRates(copy_bytes_per_s=3.0e12, matmul_flops_per_s=7.5e14, how='')
    whole = rates.time_s(cost.prefill_flops(tokens, cached), cost.prefill_bytes(tokens, cached))
    sequential = rates.sequential_time_s(phases)
    assert whole <= sequential <= sum(rates.time_s(f, 0) + rates.time_s(0, b) for f, b in phases.values())
    if shape != 'qwen3.5-9b' and tokens == 1024:
        # a MoE prompt of 1K tokens: the experts stream their bytes while the dense projections are compute-bound,
        # so the phases in sequence cannot reach the whole forward's floor
        assert sequential > 1.2 * whole


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
    # each timed request's forwards by kind (CPU: all eager, none a graph)
    suffix = results['engine_pc_on.suffix.100']
    assert suffix['eager_forwards'] == [1] and suffix['graph_forwards'] == [0]
    assert results['engine_pc_off.cold.160']['eager_forwards'][0] >= 1
    assert results['hf.suffix.50']['cache_matches_full_forward'] is True
    assert results['engine.cb']['num_requests'] == 6 and 0 < results['engine.cb']['busy_share'] <= 1
    # where the forwards went: on the CPU every one is eager (no CUDA graphs), at most one per step
    cb = results['engine.cb']
    assert 0 < cb['forwards_eager'] <= cb['steps']
    assert cb['forwards_graph_replays'] == cb['forwards_graph_first_uses'] == 0
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


def test_decode_rows_time_full_decode_batches_with_and_without_async_scheduling(bench):
    # batch 8 of 32-token prompts under a 128-token prefill budget: two prefill chunks stagger the first tokens by a
    # step (the old "delivered == steps x batch" arithmetic failed here under async scheduling: 60 of 64)
    summary = bench.main(['--smoke', '--rows', 'decode', '--systems', 'engine', '--phase', 'off', '--async-scheduling',
                          '--compare-sync', '--decode-batches', '1', '8', '--decode-steps', '6'])
    results = summary['results']
    for key, overlapped in (('engine.decode.8', 6), ('engine_sync.decode.8', 0), ('engine.decode.1', 6)):
        row = results[key]
        assert 'error' not in row, row
        batch = int(key.rsplit('.', 1)[1])
        assert row['steps'] == 6 and row['delivered_tokens'] == 6 * batch
        assert row['overlapped_steps'] == overlapped and row['async_scheduling'] == (overlapped > 0)
        assert row['decode_tok_s'] == pytest.approx(batch * 1e3 / row['step_ms'])


def test_decode_window_check_rejects_what_a_short_request_leaves_in_the_window(bench, tmp_path):
    """The old row's requests (exactly settle + steps + 2 tokens) under async scheduling, stepped as the row steps:
    the early prefill chunk's requests finish inside the window, the delivered tokens fall short of steps x batch,
    and the check on the engine's per-step records rejects the window."""
    rows = sys.modules['real_depth_rows']
    from bench_harness import Rec, make_prompt, record_into

    from lmdeploy.pytorch.messages import SamplingParams
    args = bench.parse_args(['--smoke', '--async-scheduling'])
    args.out = None
    config, _, _ = bench.make_config(args)
    config.save_pretrained(tmp_path)
    engine, _ = bench.build_engine(bench.RealDepthBench(args), str(tmp_path), False)
    batch, steps = 8, 6
    new = rows.SETTLE + steps + 2
    params = SamplingParams(max_new_tokens=new, min_new_tokens=new, temperature=0.0, stop_token_ids=())
    recs = [Rec() for _ in range(batch)]
    for i, rec in enumerate(recs):
        engine.add_request(make_prompt(32, i, config.vocab_size), params, record_into(rec))
    while any(r.first is None for r in recs):
        engine.step()
    for _ in range(rows.SETTLE):
        engine.step()
    window, delivered0 = [engine.stats_snapshot.batch], sum(len(r.times) for r in recs)
    for _ in range(steps):
        engine.step()
        window.append(engine.stats_snapshot.batch)
    assert sum(len(r.times) for r in recs) - delivered0 < steps * batch
    with pytest.raises(RuntimeError, match='not one decode batch of 8'):
        rows.check_decode_window(window, batch)
    rows.check_decode_window(window[:2], batch)  # the window's start was still the whole batch decoding
    engine.run_until_idle()
