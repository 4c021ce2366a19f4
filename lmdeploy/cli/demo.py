"""`lmdeploy demo`: a short multi-turn chat on the built-in tiny model through the pipeline.

Each turn resends the whole history, as a chat client does, so with prefix caching on, later turns are served
partly from the cache; every turn prints its reply, the cached prompt tokens and the latency.
"""
from __future__ import annotations

import argparse
import time

from ..messages import GenerationConfig
from .engine_args import add_engine_args, engine_config_from_args, resolve_model_path

DEMO_TURNS = (
    'Hello! Who are you?',
    'Tell me something about the sea.',
    'And what about the mountains?',
)


def add_parser(sub) -> None:
    parser = sub.add_parser('demo', help='multi-turn chat on the built-in tiny demo model')
    parser.add_argument('model_path', nargs='?', default=None,
                        help='HF folder or Hub id (default: the built-in demo model)')
    parser.add_argument('--max-new-tokens', type=int, default=16)
    add_engine_args(parser)
    parser.set_defaults(func=run, device='cpu', enable_prefix_caching=True)


def run(args: argparse.Namespace) -> int:
    from .. import pipeline
    model_path = resolve_model_path(args.model_path)
    config = engine_config_from_args(args)
    print(f'model: {model_path}  device: {config.device_type}  prefix caching: {config.enable_prefix_caching}')
    history: list[dict] = [{'role': 'system', 'content': 'You are a tiny demo model with random weights.'}]
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens)
    with pipeline(model_path, config) as pipe:
        for turn, question in enumerate(DEMO_TURNS, 1):
            history.append({'role': 'user', 'content': question})
            start = time.perf_counter()
            response = pipe(list(history), gen)
            latency_ms = (time.perf_counter() - start) * 1000
            history.append({'role': 'assistant', 'content': response.text})
            print(f'[turn {turn}] user: {question}')
            print(f'[turn {turn}] assistant: {response.text!r}')
            print(f'[turn {turn}] prompt tokens: {response.input_token_len}  cached tokens: '
                  f'{response.cached_tokens}  generated: {response.generate_token_len}  latency: {latency_ms:.1f} ms')
    return 0
