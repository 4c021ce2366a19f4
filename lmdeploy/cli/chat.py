"""`lmdeploy chat`: an interactive multi-turn terminal chat."""
from __future__ import annotations

import argparse
import sys
import time

from ..messages import GenerationConfig
from .engine_args import add_engine_args, engine_config_from_args, resolve_model_path

HELP = 'Type a message and press enter. Commands: /reset (new conversation), /exit.'


def add_parser(sub) -> None:
    parser = sub.add_parser('chat', help='interactive chat in the terminal')
    parser.add_argument('model_path', nargs='?', default=None,
                        help='HF folder or Hub id (default: the built-in demo model)')
    parser.add_argument('--max-new-tokens', type=int, default=256)
    parser.add_argument('--temperature', type=float, default=0.0)
    parser.add_argument('--system', default=None, help='system prompt')
    parser.add_argument('--show-cached', action='store_true', help='print cached prompt tokens after each turn')
    add_engine_args(parser)
    parser.set_defaults(func=run)


def _system(args) -> list[dict]:
    return [{'role': 'system', 'content': args.system}] if args.system else []


def run(args: argparse.Namespace, stdin=None, stdout=None) -> int:
    from .. import pipeline
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0,
                           temperature=args.temperature or 1.0)
    history = _system(args)
    with pipeline(resolve_model_path(args.model_path), engine_config_from_args(args)) as pipe:
        print(HELP, file=stdout, flush=True)
        while True:
            print('>>> ', end='', file=stdout, flush=True)
            line = stdin.readline()
            if not line or line.strip() == '/exit':
                break
            text = line.strip()
            if not text:
                continue
            if text == '/reset':
                history = _system(args)
                continue
            history.append({'role': 'user', 'content': text})
            start, reply, last = time.perf_counter(), '', None
            try:
                for last in pipe.stream_infer([list(history)], gen):
                    reply += last.text
                    print(last.text, end='', file=stdout, flush=True)
            except ValueError as exc:
                history.pop()
                print(f'error: {exc}', file=stdout, flush=True)
                continue
            print(file=stdout, flush=True)
            history.append({'role': 'assistant', 'content': reply})
            if args.show_cached and last is not None:
                print(f'[cached tokens: {last.cached_tokens}/{last.input_token_len}, '
                      f'{(time.perf_counter() - start) * 1000:.0f} ms]', file=stdout, flush=True)
    return 0
