"""`python -m lmdeploy.bench [prefix-cache] [flags]`; with no benchmark named, runs `prefix-cache`."""
from __future__ import annotations

import argparse
import sys

from . import BENCHMARKS, add_benchmarks


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog='python -m lmdeploy.bench', description='lmdeploy benchmarks')
    add_benchmarks(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in BENCHMARKS + ('-h', '--help'):
        argv.insert(0, 'prefix-cache')
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == '__main__':
    sys.exit(main())
