"""`tp` configuration: the flag, the head-divisibility checks, and the refusals at engine start (before any
weight is read or any worker is spawned)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from lmdeploy.cli.engine_args import add_engine_args, engine_config_from_args
from lmdeploy.cli.entrypoint import main
from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.models.tp_geometry import TensorParallelError, tp_geometry


def _cfg(heads=4, kv=2, lin_k=0, lin_v=0, nested=False):
    text = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv, linear_num_key_heads=lin_k,
                           linear_num_value_heads=lin_v)
    return SimpleNamespace(text_config=text) if nested else text


@pytest.mark.parametrize('bad', [0, -1, 1.5, '2', True])
def test_config_rejects_a_tp_that_is_not_a_positive_int(bad):
    with pytest.raises(ValueError, match='tp must be a positive int'):
        PytorchEngineConfig(device_type='cpu', tp=bad)


def test_tp_flag_reaches_the_engine_config():
    import argparse
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(['--device', 'cpu', '--tp', '2'])).tp == 2
    assert engine_config_from_args(parser.parse_args(['--device', 'cpu'])).tp == 1


def test_tp_must_divide_the_attention_heads():
    with pytest.raises(TensorParallelError, match=r'attention heads \(num_attention_heads=6\)'):
        tp_geometry(_cfg(heads=6, kv=2), 4)


def test_tp_must_divide_the_gated_delta_key_heads():
    with pytest.raises(TensorParallelError, match=r'gated-delta key heads \(linear_num_key_heads=2\)'):
        tp_geometry(_cfg(heads=8, kv=2, lin_k=2, lin_v=6, nested=True), 4)


def test_kv_heads_must_divide_or_be_divided_by_tp():
    with pytest.raises(TensorParallelError, match=r'KV heads \(num_key_value_heads=3\)'):
        tp_geometry(_cfg(heads=6, kv=3), 2)


def test_kv_heads_fewer_than_tp_are_replicated_evenly():
    g = tp_geometry(_cfg(heads=8, kv=2, lin_k=4, lin_v=12), 4)
    assert (g.kv_replicas, g.kv_heads_per_rank, g.heads_per_rank) == (2, 1, 2)
    assert [g.kv_head_range(r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    g = tp_geometry(_cfg(heads=8, kv=4), 2)
    assert (g.kv_replicas, [g.kv_head_range(r) for r in range(2)]) == (1, [(0, 2), (2, 4)])


@pytest.mark.parametrize('arch', ['qwen3', 'qwen3_5', 'qwen3_next'])
def test_engine_refuses_a_tp_that_does_not_fit_before_loading_weights_or_spawning(tiny_model_factory, arch):
    import multiprocessing

    from lmdeploy.speculative_config import SpeculativeConfig
    path = tiny_model_factory(arch)
    start = time.perf_counter()
    with pytest.raises(TensorParallelError, match='does not divide the attention heads'):
        Engine(path, PytorchEngineConfig(device_type='cpu', tp=3))
    with pytest.raises(TensorParallelError, match='tp=2: tensor parallelism cannot be combined with LoRA adapters'):
        Engine(path, PytorchEngineConfig(device_type='cpu', tp=2, adapters={'a': '/nonexistent'}))
    with pytest.raises(TensorParallelError, match='cannot be combined with speculative decoding'):
        Engine(path, PytorchEngineConfig(device_type='cpu', tp=2,
                                         speculative_config=SpeculativeConfig(method='mtp', num_speculative_tokens=1)))
    assert time.perf_counter() - start < 5
    assert not [p for p in multiprocessing.active_children() if p.name.startswith('lmdeploy-tp')]


def test_cli_prints_the_tp_refusal_in_one_line(tiny_model_factory, capsys):
    rc = main(['chat', tiny_model_factory('qwen3'), '--device', 'cpu', '--tp', '3'])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith('lmdeploy: error: tp=3 does not divide the attention heads') and '\n' not in err, err
