"""Merge the per-workload JSON summaries of `scripts/gpu_bench_prefix.sh` (`<workload>.log`, last line) into one
report table and one hit-rate plot, as `lmdeploy bench prefix-cache --workload all` would have written them.

    python3 scripts/merge_prefix_bench.py OUT/prefix_bench/*.log --out /tmp/merged [--header 'H200, bf16, ...']
"""
from __future__ import annotations

import argparse
import dataclasses
import json

from lmdeploy.bench.report import RunResult, compare_outputs, write_outputs


def load_runs(path: str) -> list[RunResult]:
    with open(path) as f:
        last = f.read().strip().splitlines()[-1]
    names = {f.name for f in dataclasses.fields(RunResult)}
    return [RunResult(**{k: v for k, v in run.items() if k in names}) for run in json.loads(last)['runs']]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('logs', nargs='+')
    parser.add_argument('--out', required=True)
    parser.add_argument('--header', action='append', default=[])
    args = parser.parse_args()
    results = compare_outputs([run for path in args.logs for run in load_runs(path)])
    md, png = write_outputs(results, args.out, args.header)
    print(md, png)


if __name__ == '__main__':
    main()
