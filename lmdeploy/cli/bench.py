"""`lmdeploy bench prefix-cache`: prefix-cache hit rate, TTFT and throughput on seeded traces."""
from __future__ import annotations

from ..bench import add_benchmarks


def add_parser(sub) -> None:
    add_benchmarks(sub.add_parser('bench', help='benchmarks: prefix-cache'))
