"""`benchmark/bench_decode_host.py` at tiny sizes on the CPU (no speed asserted): the phase timer still wraps calls
the engine makes (a renamed or moved call would leave its phase unmeasured), every timed step is counted, and the
continuous-batching mix drains with every request at its full length and prefix-cache hits among them."""
from __future__ import annotations

import pytest
from bench_scripts import bench_script

pytest.importorskip('transformers')


@pytest.fixture(scope='module')
def bench():
    with bench_script('bench_decode_host') as module:
        yield module


def test_decode_rows_measure_every_phase_on_every_timed_step(bench):
    results = bench.main(['--batches', '1', '3', '--steps', '3', '--repeat', '2'])
    for async_scheduling in (False, True):
        for batch in (1, 3):
            phases, num_steps = results['decode'][async_scheduling][batch]
            assert num_steps == 3  # every timed step was a pure decode step of the whole batch
            for phase in bench.PHASES:
                assert phases[phase] > 0, (async_scheduling, batch, phase)
            assert phases['step (wall)'] >= sum(phases[p] for p in bench.PHASES)


def test_mix_carries_prefills_beside_decodes_and_drains_every_request(bench):
    results = bench.main(['--batches', '--mix-requests', '8', '--mix-rate', '1.0', '--mix-prompt-len', '40', '200',
                          '--mix-output-len', '2', '6', '--mix-shared', '0.5', '--mix-blocks', '256'])
    rows, counts = results['mix']
    assert counts['finished'] == 8 and not counts['errors']
    assert counts['generated'] == counts['expected_generated']  # every request ran to its length
    assert counts['cached_tokens'] > 0  # resent prefixes were served from the cache
    kinds = counts['steps_by_kind']
    assert kinds['prefill'] > 0 and kinds['decode'] > 0 and sum(kinds.values()) == counts['steps']
    assert counts['calls']['schedule'] == counts['steps']  # each timed step scheduled once
    for phase in bench.PHASES:
        assert rows['prefill steps'][phase] > 0, phase
        assert rows['decode steps'][phase] > 0, phase
    # the mix ran as the server does, its start-up heap frozen, and reports the collector's passes during its steps
    assert counts['frozen_objects'] > 0 and set(counts['gc']) == {0, 1, 2}
    assert counts['max_step_ms'] >= rows['all steps']['step (wall)']


def test_mix_without_the_freeze_leaves_the_heap_unfrozen(bench):
    results = bench.main(['--batches', '--mix-requests', '2', '--mix-prompt-len', '40', '80', '--mix-output-len', '2',
                          '3', '--no-gc-freeze'])
    assert results['mix'][1]['frozen_objects'] == 0 and results['mix'][1]['finished'] == 2
