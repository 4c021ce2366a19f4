"""`lmdeploy bench prefix-cache`: oracle and workload units, plus one CPU smoke run on the hybrid demo model."""
from __future__ import annotations

import json

import pytest

from lmdeploy.bench import workloads
from lmdeploy.bench.oracle import MISS_REASONS, RequestTiming, attribute_misses, oracle_hits
from lmdeploy.bench.report import SUMMARY_KEYS


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


@pytest.mark.parametrize('name', workloads.WORKLOADS)
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
    assert (out_dir / 'report.md').read_text().count('| multi_turn |') == len(MODES)
    assert (out_dir / 'hit_rate.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
