"""`lmdeploy chat`: a scripted multi-turn session through stdin/stdout."""
from __future__ import annotations

import io

from lmdeploy.cli.entrypoint import build_parser


def test_chat_multi_turn_shows_cached_tokens(tiny_model_factory):
    path = tiny_model_factory('qwen3_5')
    args = build_parser().parse_args(['chat', path, '--device', 'cpu', '--enable-prefix-caching', '--show-cached',
                                      '--max-new-tokens', '4', '--num-gpu-blocks', '64', '--cache-block-seq-len',
                                      '16'])
    stdin = io.StringIO('Hello there!\nTell me more.\n/reset\nHello there!\n/exit\n')
    stdout = io.StringIO()
    assert args.func(args, stdin=stdin, stdout=stdout) == 0
    lines = [line for line in stdout.getvalue().splitlines() if line.startswith('[cached tokens:')]
    assert len(lines) == 3
    cached = [int(line.split(':')[1].split('/')[0]) for line in lines]
    # Turn 2 resends turn 1 (prompt + reply): its prompt is served partly from the cache.
    assert cached[0] == 0 and cached[1] > 0
