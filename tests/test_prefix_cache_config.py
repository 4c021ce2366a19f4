"""`PrefixCacheConfig`: one record for every prefix-cache knob, the flat `PytorchEngineConfig` names still accepted,
and one CLI flag per knob."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from lmdeploy import PrefixCacheConfig, PytorchEngineConfig
from lmdeploy.cli.engine_args import add_engine_args, engine_config_from_args


def test_flat_names_build_the_record_and_stay_readable():
    config = PytorchEngineConfig(device_type='cpu', block_size=16, prefix_cache_state_budget=3,
                                 prefix_cache_checkpoint_mode='aligned', prefix_cache_decode_state_interval=32,
                                 prefix_cache_reply_checkpoints=False, prefix_cache_prefill_state_cap=5)
    assert config.prefix_cache == PrefixCacheConfig(state_budget=3, checkpoint_mode='aligned',
                                                    decode_state_interval=32, reply_checkpoints=False,
                                                    prefill_state_cap=5)


def test_a_given_record_sets_the_flat_names():
    record = PrefixCacheConfig(state_budget=2, value_eviction=False, prefill_state_interval=100)
    config = PytorchEngineConfig(device_type='cpu', prefix_cache=record)
    assert config.prefix_cache is record
    assert (config.prefix_cache_state_budget, config.prefix_cache_value_eviction,
            config.prefix_cache_prefill_state_interval) == (2, False, 100)


def test_a_flat_name_that_disagrees_with_the_record_is_refused():
    with pytest.raises(ValueError, match='prefix_cache_state_budget disagree'):
        PytorchEngineConfig(device_type='cpu', prefix_cache=PrefixCacheConfig(state_budget=2),
                            prefix_cache_state_budget=4)


@pytest.mark.parametrize('field, value', [('state_budget', -1), ('checkpoint_mode', 'sometimes'),
                                          ('prefill_state_cap', 1.5), ('prompt_logits', 'yes')])
def test_bad_knobs_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        PrefixCacheConfig(**{field: value})


def test_resolution_rounds_the_in_prefill_interval_up_to_a_block_and_checks_the_decode_interval():
    assert PrefixCacheConfig(prefill_state_interval=100).resolved(64).prefill_state_interval == 128
    with pytest.raises(ValueError, match='multiple of block_size'):
        PrefixCacheConfig(decode_state_interval=100).resolved(64)


def test_the_cli_exposes_every_knob():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    want = PrefixCacheConfig(state_budget=3, checkpoint_mode='aligned', decode_state_interval=128,
                             reply_checkpoints=False, prompt_logits=False, branch_checkpoints=False,
                             value_eviction=False, prefill_state_interval=0, prefill_state_cap=7)
    argv = ['--device', 'cpu', '--prefix-cache-state-budget', '3', '--prefix-cache-checkpoint-mode', 'aligned',
            '--prefix-cache-decode-state-interval', '128', '--no-prefix-cache-reply-checkpoints',
            '--no-prefix-cache-prompt-logits', '--no-prefix-cache-branch-checkpoints',
            '--no-prefix-cache-value-eviction', '--prefix-cache-prefill-state-interval', '0',
            '--prefix-cache-prefill-state-cap', '7']
    assert engine_config_from_args(parser.parse_args(argv)).prefix_cache == want
    assert engine_config_from_args(parser.parse_args(['--device', 'cpu'])).prefix_cache == PrefixCacheConfig()
    flags = {action.dest for action in parser._actions}
    assert {f'prefix_cache_{f.name}' for f in dataclasses.fields(PrefixCacheConfig)} <= flags


def test_the_record_reaches_the_prefix_cache_resolved(make_engine, tiny_model_factory):
    knobs = PrefixCacheConfig(state_budget=3, prefill_state_interval=20, reply_checkpoints=False,
                              checkpoint_mode='aligned', value_eviction=False)
    engine = make_engine(tiny_model_factory('qwen3_5'), cache=True, prefix_cache=knobs)
    trie = engine.scheduler.trie
    assert engine.cache_config.prefix_cache == dataclasses.replace(knobs, prefill_state_interval=32)
    assert trie.config is engine.cache_config.prefix_cache and not trie.exact_steps
    assert (trie.policy.prefill_state_interval, trie.policy.reply_checkpoints) == (32, False)
    off = make_engine(tiny_model_factory('qwen3_5'), prefix_cache=knobs)
    assert off.cache_config.prefix_cache is None and off.scheduler.trie is None
