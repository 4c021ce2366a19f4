"""`lmdeploy chat`: a scripted multi-turn session through stdin/stdout."""
from __future__ import annotations

import io

import pytest

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


def test_engine_flags_reach_the_engine_config():
    import argparse

    from lmdeploy.cli.engine_args import add_engine_args, engine_config_from_args
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(
        ['--device', 'cpu', '--enable-prefix-caching', '--cache-block-seq-len', '32', '--eager-mode',
         '--prefix-cache-checkpoint-mode', 'aligned', '--prefix-cache-decode-state-interval', '64',
         '--prefix-cache-prefill-state-interval', '0', '--prefix-cache-state-budget', '3']))
    assert (config.device_type, config.block_size, config.enable_prefix_caching, config.eager_mode) == (
        'cpu', 32, True, True)
    assert (config.prefix_cache_checkpoint_mode, config.prefix_cache_decode_state_interval,
            config.prefix_cache_prefill_state_interval, config.prefix_cache_state_budget) == ('aligned', 64, 0, 3)
    with pytest.raises(SystemExit):
        parser.parse_args(['--prefix-cache-checkpoint-mode', 'sometimes'])
