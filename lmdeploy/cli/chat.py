"""`lmdeploy chat`: an interactive multi-turn terminal chat.

On a terminal the prompt is read with `readline` (line editing, and history kept in `~/.lmdeploy_chat_history`).
Ctrl-C during a reply stops it (the request is aborted in the engine) and keeps the conversation: the partial
reply stays in the history as the assistant's turn. Ctrl-C at the prompt clears the line; Ctrl-D or `/exit` quits.
Scripted use (stdin not a terminal) reads plain lines.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

from ..messages import GenerationConfig
from .engine_args import add_engine_args, engine_config_from_args, resolve_model_path

HELP = 'Type a message and press enter. Ctrl-C stops a reply. Commands: /reset (new conversation), /exit.'
HISTORY_FILE = os.path.join(os.path.expanduser('~'), '.lmdeploy_chat_history')


def add_parser(sub) -> None:
    parser = sub.add_parser('chat', help='interactive chat in the terminal')
    parser.add_argument('model_path', nargs='?', default=None,
                        help='HF folder or Hub id (default: the built-in demo model)')
    parser.add_argument('--max-new-tokens', type=int, default=256)
    parser.add_argument('--temperature', type=float, default=0.0)
    parser.add_argument('--system', default=None, help='system prompt')
    parser.add_argument('--show-cached', action='store_true',
                        help='print cached prompt tokens after each turn (turns prefix caching on)')
    add_engine_args(parser)
    parser.set_defaults(func=run)


def _system(args) -> list[dict]:
    return [{'role': 'system', 'content': args.system}] if args.system else []


class _Prompt:
    """Reads one line: `input()` with readline on a terminal, plain `readline()` otherwise. None at EOF."""

    def __init__(self, stdin, stdout):
        self.stdin, self.stdout = stdin, stdout
        self.interactive = stdin is sys.stdin and stdin.isatty()
        self.readline = None
        if self.interactive:
            with contextlib.suppress(ImportError):
                import readline
                self.readline = readline
                with contextlib.suppress(OSError):
                    readline.read_history_file(HISTORY_FILE)

    def read(self) -> str | None:
        if self.interactive:
            try:
                return input('>>> ')
            except EOFError:
                return None
        print('>>> ', end='', file=self.stdout, flush=True)
        line = self.stdin.readline()
        return line if line else None

    def close(self) -> None:
        if self.readline is not None:
            with contextlib.suppress(OSError):
                self.readline.write_history_file(HISTORY_FILE)


def _reply(pipe, history: list[dict], gen: GenerationConfig, stdout) -> tuple[str, object, bool]:
    """Stream one reply; returns (text, last response, interrupted). Ctrl-C closes the stream, which aborts it."""
    reply, last = '', None
    stream = pipe.stream_infer([list(history)], gen)
    try:
        for last in stream:
            reply += last.text
            print(last.text, end='', file=stdout, flush=True)
    except KeyboardInterrupt:
        stream.close()
        return reply, last, True
    return reply, last, False


def run(args: argparse.Namespace, stdin=None, stdout=None) -> int:
    from .. import pipeline
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0,
                           temperature=args.temperature or 1.0)
    if args.show_cached and not args.enable_prefix_caching:
        args.enable_prefix_caching = True
        print('--show-cached: prefix caching turned on', file=stdout, flush=True)
    history = _system(args)
    prompt = _Prompt(stdin, stdout)
    with pipeline(resolve_model_path(args.model_path), engine_config_from_args(args)) as pipe:
        print(HELP, file=stdout, flush=True)
        while True:
            try:
                line = prompt.read()
            except KeyboardInterrupt:  # at the prompt: drop the line, keep going
                print(file=stdout, flush=True)
                continue
            if line is None or line.strip() == '/exit':
                break
            text = line.strip()
            if not text:
                continue
            if text == '/reset':
                history = _system(args)
                continue
            history.append({'role': 'user', 'content': text})
            start = time.perf_counter()
            try:
                reply, last, interrupted = _reply(pipe, history, gen, stdout)
            except ValueError as exc:
                history.pop()
                print(f'error: {exc}', file=stdout, flush=True)
                continue
            print(' [interrupted]' if interrupted else '', file=stdout, flush=True)
            history.append({'role': 'assistant', 'content': reply})
            if args.show_cached and last is not None:
                print(f'[cached tokens: {last.cached_tokens}/{last.input_token_len}, '
                      f'{(time.perf_counter() - start) * 1000:.0f} ms]', file=stdout, flush=True)
    prompt.close()
    return 0
