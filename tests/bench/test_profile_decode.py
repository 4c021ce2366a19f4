"""`benchmark/profile_decode.py --smoke` (tiny float32 shape on the CPU; no speed asserted) and the kernel tables it
shares with `profile_prefill.py` (`kernel_profile.py`): categories of real kernel names, the busy / idle arithmetic
against a hand-worked timeline, the rooflines against `real_depth_floors` computed here."""
from __future__ import annotations

import sys

import pytest
from bench_scripts import bench_script

pytest.importorskip('transformers')


@pytest.fixture(scope='module')
def profile():
    with bench_script('profile_decode') as module:
        yield module


def test_kernel_names_fall_in_their_categories(profile):
    category = sys.modules['kernel_profile'].category
    assert category('_decode_split_kernel') == 'attention'
    assert category('fused_recurrent_gated_delta_rule_fwd_kernel') == 'gated delta rule'
    assert category('_conv_sequence_kernel') == 'conv'
    assert category('nvjet_tst_128x64_64x8_1x1_v_bz_coopB_TNN') == 'gemm'
    assert category('_rms_norm_kernel') == 'norm / rotary / fill'
    assert category('Memcpy HtoD (Pinned -> Device)') == 'copy'
    assert category('void at::native::reduce_kernel<argmax>') == 'other'


def test_idle_gaps_union_overlaps_and_measure_the_holes(profile):
    idle_gaps = sys.modules['kernel_profile'].idle_gaps
    span, busy, gaps = idle_gaps([(10, 20), (15, 30), (40, 45), (41, 42), (60, 70)])
    assert (span, busy, gaps) == (60, 35, [10, 15])
    assert idle_gaps([]) == (0.0, 0.0, [])


def test_busy_within_clips_intervals_to_the_window(profile):
    busy_within = sys.modules['kernel_profile'].busy_within
    intervals = [(10, 20), (15, 30), (40, 45), (60, 70)]
    assert busy_within(intervals, 18, 42) == 12 + 2  # [18, 30] and [40, 42]
    assert busy_within(intervals, 30, 40) == 0 and busy_within(intervals, 0, 100) == 35


def test_smoke_profiles_full_decode_batches_against_the_weight_roofline(profile):
    summary = profile.main(['--smoke', '--async-scheduling', '--batches', '1', '8', '--steps', '4'])
    floors = sys.modules['real_depth_floors']
    args = profile.parse_args(['--smoke'])
    config, _, _ = sys.modules['bench_real_depth'].make_config(args)
    cost = floors.model_cost(config, weight_bytes=4)
    copy_bytes_per_s = summary['copy_gb_s'] * 1e9
    assert [r['batch'] for r in summary['results']] == [1, 8] and summary['async_scheduling'] is True
    for res in summary['results']:
        batch = res['batch']
        assert res['overlapped_steps'] == 4  # every timed step launched while the one before was in flight
        weights = cost.decode_bytes(batch, 32 + 2 + 2, weights_only=True)
        assert res['roofline_weights_ms'] == pytest.approx(weights / copy_bytes_per_s * 1e3)
        assert res['share_of_weight_roofline'] == pytest.approx(res['roofline_weights_ms'] / res['step_ms'])
        assert res['roofline_all_ms'] > res['roofline_weights_ms']
        assert res['kernels_per_step'] > 0 and res['busy_ms_per_step'] > 0
        assert res['categories_ms_per_step'] and len(res['longest_gaps_us']) <= 4
        assert res['decode_tok_s'] == pytest.approx(batch * 1e3 / res['step_ms'])


def test_profile_prefill_smoke_still_prints_its_tables(capsys):
    with bench_script('profile_prefill') as module:
        module.main(['--smoke', '--num-blocks', '48'])  # a pool of its own size
    out = capsys.readouterr().out
    assert 'category' in out and '% wall' in out and 'profiled wall' in out


def test_profile_prefill_suffix_after_a_cached_prefix(capsys):
    # --prefix: each timed request resumes after the prefix it cached first, and --host-top adds the host table
    with bench_script('profile_prefill') as module:
        module.main(['--smoke', '--prefix', '150', '--host-top', '5', '--gaps', '3', '--phases', '--cprofile', '4',
                     '--cprofile-reps', '2', '--launch', '--host-times', '6'])
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert out.count('(cached 150)') == 3 and 'suffix after a cached 150' in out
    assert 'TTFT median' in out and 'over 2 requests (cached 150-150)' in out and 'no CUDA graphs captured' in out
    # --cprofile: both tables, four functions each, in us per request; the step loop among the cumulative ones
    own = out[out.index('by own time under cProfile'):].splitlines()[2:6]
    cumulative = out[out.index('by cumulative time under cProfile'):].splitlines()[2:6]
    assert len(own) == len(cumulative) == 4 and all(len(line.split()) >= 4 for line in own + cumulative)
    assert float(cumulative[0].split()[1]) >= float(cumulative[-1].split()[1]) > 0
    assert 'host op' in out and 'profiled wall' in out
    assert 'device span' in out and ' gaps' in out
    # --phases: the engine's named host phases of the profiled request, in order, each with a duration
    rows = [line.split() for line in captured.out[captured.out.index('host phase'):].splitlines()[1:]]
    rows = [(r[0], *map(float, r[1:])) for r in rows if len(r) == 5]
    names = [r[0] for r in rows]
    for name in ('add_request', 'schedule', 'make_inputs', 'upload', 'restore', 'eager', 'save', 'sample',
                 'resolve', 'deliver', 'commit'):
        assert name in names, (name, names)
    assert names[:3] == ['add_request', 'schedule', 'make_inputs']
    last = len(names) - 1 - names[::-1].index('deliver')  # the step of the first token samples, then delivers
    assert names.index('sample') < last
    assert [r[1] for r in rows] == sorted(r[1] for r in rows)
    assert all(0 <= r[3] == pytest.approx(r[2] - r[1], abs=0.011) for r in rows)
    # --host-times: the same request path timed without a profiler, the phases in the order a request meets them
    # (each timed request's prefix cached just before it: more prefixes than the pool holds, all hits)
    assert 'over 6 requests, cached 150-150 tokens' in captured.out
    timed = captured.out[captured.out.index('host phases, no profiler'):].splitlines()[2:]
    timed = {r[0]: (float(r[1]), float(r[2])) for r in (line.split() for line in timed) if len(r) == 3}
    order = ['add_request', 'schedule', 'make_inputs', 'upload']
    assert all(name in timed for name in order), timed
    assert [timed[n][0] for n in order] == sorted(timed[n][0] for n in order)
    assert all(took >= 0 for _, took in timed.values())
