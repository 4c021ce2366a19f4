"""Benchmarks run against the engine through the public pipeline (`lmdeploy bench ...`).

`prefix_cache` is the runner (CLI flags, trace driver), `engine_probe` reads the engine's statistics records,
`workloads` builds seeded traces, `oracle` computes the capacity-free hit rate and the miss attribution, `report`
renders results; `http_load` measures a tiny request's latency beside large bodies against a live server
(bench_server_faults.py, tests).
"""
from __future__ import annotations

import argparse

BENCHMARKS = ('prefix-cache',)


def add_benchmarks(parser: argparse.ArgumentParser) -> None:
    """Nested benchmark subcommands under `parser` (used by `lmdeploy bench` and `python -m lmdeploy.bench`)."""
    from .prefix_cache import add_arguments, run_cli
    benchmarks = parser.add_subparsers(dest='benchmark', required=True)
    prefix_cache = benchmarks.add_parser(
        'prefix-cache', help='hit rate vs oracle, TTFT, throughput with the prefix cache off/aligned/exact',
        description='Replay seeded traces (multi_turn, shared_doc, long_context, repeat, branching) with the prefix '
                    'cache off and in aligned / exact checkpoint mode.')
    add_arguments(prefix_cache)
    prefix_cache.set_defaults(func=run_cli)
