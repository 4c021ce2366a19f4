"""`SpeculativeConfig` on `PytorchEngineConfig`, its CLI flags (LMDeploy's names), and the engine's refusals."""
from __future__ import annotations

import argparse

import pytest

from lmdeploy import PytorchEngineConfig, SpeculativeConfig
from lmdeploy.cli.engine_args import add_engine_args, engine_config_from_args
from lmdeploy.speculative_config import MAX_DRAFT_TOKENS


def _parse(argv: list[str]) -> PytorchEngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(['--device', 'cpu', *argv]))


def test_flags_build_the_speculative_config():
    config = _parse(['--speculative-algorithm', 'mtp', '--speculative-num-draft-tokens', '3'])
    assert config.speculative_config == SpeculativeConfig(method='mtp', num_speculative_tokens=3)
    assert _parse([]).speculative_config is None


def test_draft_tokens_without_an_algorithm_are_refused():
    with pytest.raises(ValueError, match='needs --speculative-algorithm'):
        _parse(['--speculative-num-draft-tokens', '2'])


def test_unknown_algorithm_is_refused_by_the_parser():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(['--speculative-algorithm', 'eagle9'])


@pytest.mark.parametrize('k', [0, -1, MAX_DRAFT_TOKENS + 1, 1.5, True])
def test_draft_token_count_out_of_range_is_refused(k):
    with pytest.raises(ValueError, match='num_speculative_tokens'):
        SpeculativeConfig(num_speculative_tokens=k)


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="method must be one of \\('mtp',\\)"):
        SpeculativeConfig(method='eagle3')


def test_engine_config_takes_only_the_record():
    with pytest.raises(ValueError, match='speculative_config must be a SpeculativeConfig'):
        PytorchEngineConfig(device_type='cpu', speculative_config={'method': 'mtp'})
