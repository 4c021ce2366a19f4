"""The `lmdeploy` command: `demo`, `chat`, `serve api_server`, `bench`."""
from __future__ import annotations

import argparse
import atexit
import logging
import os
import sys

from ..version import __version__
from . import chat, demo


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog='lmdeploy', description='Inference and serving engine for hybrid LLMs')
    parser.add_argument('-v', '--version', action='version', version=f'lmdeploy {__version__}')
    sub = parser.add_subparsers(dest='command', required=True)
    demo.add_parser(sub)
    chat.add_parser(sub)
    try:
        from . import serve
        serve.add_parser(sub)
    except ImportError:  # pragma: no cover - serving extras missing
        pass
    try:
        from . import bench
        bench.add_parser(sub)
    except ImportError:  # pragma: no cover
        pass
    return parser


def _configure_logging() -> None:
    logger = logging.getLogger('lmdeploy')
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter('%(asctime)s %(levelname)s %(name)s: %(message)s'))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    from ..pytorch.models.model_source import ModelNotFoundError
    from ..pytorch.models.tp_geometry import TensorParallelError
    args = build_parser().parse_args(argv)
    _configure_logging()
    try:
        return int(args.func(args) or 0)
    except (ModelNotFoundError, TensorParallelError) as err:  # one line, not a traceback
        print(f'lmdeploy: error: {err}', file=sys.stderr)
        return 2


def run() -> None:
    """The process entry (`lmdeploy`, `python -m lmdeploy.cli.entrypoint`): `main`, then exit without tearing the
    interpreter down. Every command closes what it opened (engine, workers, sockets, executors) before `main`
    returns; what is left is freeing modules and objects, which the OS does anyway and which takes seconds on a
    loaded CPU box: enough to push a server's exit past `--timeout-graceful-shutdown`, within which lifecycle.py
    promises it. The atexit handlers still run (logging's flush among them)."""
    code = main()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == '__main__':
    run()
