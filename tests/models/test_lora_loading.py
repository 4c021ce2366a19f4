"""PEFT folder loading: config checks, key layouts, placement onto fused layers, limits, identity.

Folders are written by hand here (adapter_config.json + adapter_model.safetensors in peft's key layout) so each
refusal can be provoked; the numerical match with peft is in `test_lora_models.py`.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from engines import engine_factory
from lora_folders import write_adapter
from safetensors.torch import save_file

from lmdeploy.messages import PytorchEngineConfig, UnknownAdapterError
from lmdeploy.pytorch.messages import SamplingParams
from lmdeploy.pytorch.models.peft_adapter import load_peft_adapter

LIN, FULL = 'linear_attention', 'full_attention'
HIDDEN = 64  # the tiny models' hidden size


@pytest.fixture(scope='module')
def qwen3_5(tiny_model_factory):
    return str(tiny_model_factory('qwen3_5', num_hidden_layers=2, layer_types=[LIN, FULL]))


@pytest.fixture(scope='module')
def qwen3_next(tiny_model_factory):
    return str(tiny_model_factory('qwen3_next', num_hidden_layers=2, layer_types=[LIN, FULL]))


make_engine = engine_factory(block_size=16, kernel_block_size=8, num_gpu_blocks=32, max_batch_size=4)


B_ONLY = {'model.layers.0.linear_attn.in_proj_b': (HIDDEN, 4)}


def test_fused_slices_receive_only_their_rows(qwen3_5, tmp_path):
    # in_proj_b is rows [0, 4) of the engine's in_proj_ba; in_proj_a (rows [4, 8)) stays unadapted
    e = make_engine(qwen3_5, adapters={'ba': write_adapter(tmp_path / 'a', B_ONLY)})
    stack = e.model.model.layers[0].linear_attn.in_proj_ba.lora
    slot = e.adapters['ba'].slot
    assert stack.slice_sizes == [4, 4] and stack.lora_b[slot, :4].abs().sum() > 0
    assert stack.lora_b[slot, 4:].abs().sum() == 0 and stack.lora_b[0].abs().sum() == 0
    assert e.model.model.layers[0].linear_attn.in_proj_qkvz.lora is None  # untargeted layers get nothing


def test_vision_language_key_layout_loads_like_the_text_layout(qwen3_5, tmp_path):
    vl = {'model.language_model.layers.0.linear_attn.in_proj_b': (HIDDEN, 4)}
    a = make_engine(qwen3_5, adapters={'x': write_adapter(tmp_path / 'text', B_ONLY)})
    b = make_engine(qwen3_5, adapters={'x': write_adapter(tmp_path / 'vl', vl)})
    assert torch.equal(a.model.model.layers[0].linear_attn.in_proj_ba.lora.lora_b,
                       b.model.model.layers[0].linear_attn.in_proj_ba.lora.lora_b)


def test_identity_is_name_plus_digest_of_weights_and_config(tmp_path):
    one = load_peft_adapter('x', write_adapter(tmp_path / '1', B_ONLY, seed=1))
    other_weights = load_peft_adapter('x', write_adapter(tmp_path / '2', B_ONLY, seed=2))
    other_config = load_peft_adapter('x', write_adapter(tmp_path / '3', B_ONLY, seed=1, use_rslora=True))
    again = load_peft_adapter('x', write_adapter(tmp_path / '4', B_ONLY, seed=1))
    assert one.identity.startswith('x@') and one.identity == again.identity
    assert len({one.identity, other_weights.identity, other_config.identity}) == 3


def test_rslora_scales_by_sqrt_rank(tmp_path):
    plain = load_peft_adapter('p', write_adapter(tmp_path / 'p', B_ONLY, rank=4))
    rs = load_peft_adapter('r', write_adapter(tmp_path / 'r', B_ONLY, rank=4, use_rslora=True))
    (p,), (r,) = plain.modules.values(), rs.modules.values()
    assert p.scaling == 8 / 4 and r.scaling == 8 / 2


@pytest.mark.parametrize('config,message', [
    (dict(use_dora=True), 'DoRA'), (dict(bias='all'), 'bias'), (dict(modules_to_save=['lm_head']), 'modules_to_save'),
    (dict(alpha_pattern={'q_proj': 3}), 'alpha_pattern'), (dict(peft_type='IA3'), 'only LoRA'),
    (dict(r=0), 'r must be'),
], ids=['dora', 'bias', 'modules_to_save', 'alpha_pattern', 'ia3', 'rank0'])
def test_unsupported_adapter_configs_are_refused(tmp_path, config, message):
    with pytest.raises(ValueError, match=message):
        load_peft_adapter('x', write_adapter(tmp_path / 'x', B_ONLY, **config))


def test_non_lora_tensor_and_missing_half_are_refused(tmp_path):
    path = write_adapter(tmp_path / 'x', B_ONLY)
    save_file({'base_model.model.model.layers.0.linear_attn.in_proj_b.lora_A.weight': torch.zeros(4, HIDDEN)},
              os.path.join(path, 'adapter_model.safetensors'))
    with pytest.raises(ValueError, match='lacks lora_B'):
        load_peft_adapter('x', path)
    save_file({'base_model.model.model.embed_tokens.lora_embedding_A': torch.zeros(4, 8)},
              os.path.join(path, 'adapter_model.safetensors'))
    with pytest.raises(ValueError, match='not a LoRA A/B weight'):
        load_peft_adapter('x', path)


@pytest.mark.parametrize('module,shape,message', [
    ('model.layers.0.mlp.experts.0.gate_proj', (HIDDEN, 32), 'MoE expert'),
    ('model.layers.0.mlp.gate', (HIDDEN, 8), 'no LoRA-capable linear'),
    ('lm_head', (HIDDEN, 1024), 'lm_head'),
    ('model.layers.7.self_attn.q_proj', (HIDDEN, 64), 'no LoRA-capable linear'),
    ('mtp.layers.0.self_attn.q_proj', (HIDDEN, 64), 'MTP'),
    ('model.layers.0.linear_attn.in_proj_ba', (HIDDEN, 5), 'outputs'),
    ('model.layers.0.linear_attn.in_proj_b', (HIDDEN, 4), 'no LoRA-capable linear'),  # Qwen3.5's name
], ids=['expert', 'router', 'lm_head', 'no_layer', 'mtp', 'shape', 'other_layout'])
def test_a_module_the_engine_cannot_place_fails_start_up(qwen3_next, tmp_path, module, shape, message):
    path = write_adapter(tmp_path / 'x', {module: shape})
    with pytest.raises(ValueError, match=message):
        make_engine(qwen3_next, adapters={'x': path})


def test_vision_tower_modules_fail_start_up(tiny_model_factory, tmp_path):
    # the vision-language class loads the vision tower, whose Linear layers see image patches, not tokens
    path = str(tiny_model_factory('qwen3_5_vl', num_hidden_layers=2, layer_types=[FULL, LIN]))
    with open(os.path.join(path, 'config.json')) as f:
        width = json.load(f)['vision_config']['hidden_size']
    adapter = write_adapter(tmp_path / 'v', {'model.visual.blocks.0.mlp.linear_fc1': (width, 4 * width)})
    with pytest.raises(ValueError, match='outside the decoder layers'):
        make_engine(path, adapters={'v': adapter})


def test_limits_on_resident_adapters_and_rank_fail_start_up(qwen3_5, tmp_path):
    path = write_adapter(tmp_path / 'r8', B_ONLY, rank=8)
    with pytest.raises(ValueError, match='rank 8 but max_lora_rank is 4'):
        make_engine(qwen3_5, adapters={'x': path}, max_lora_rank=4)
    with pytest.raises(ValueError, match='max_loras'):
        PytorchEngineConfig(device_type='cpu', adapters={'x': path, 'y': path}, max_loras=1)


def test_unknown_adapter_fails_that_request_only(qwen3_5, tmp_path):
    e = make_engine(qwen3_5, adapters={'x': write_adapter(tmp_path / 'x', B_ONLY)})
    with pytest.raises(UnknownAdapterError, match="unknown adapter 'y'"):
        e.add_request([1, 2, 3], SamplingParams(max_new_tokens=2), adapter_name='y')
    outputs = []
    e.add_request([1, 2, 3], SamplingParams(max_new_tokens=2), adapter_name='x', callback=outputs.append)
    while e.has_work:
        e.step()
        e.check_integrity()
    assert sum(len(o.new_token_ids) for o in outputs) == 2


def test_adapters_flag_names_bare_paths_default_and_reaches_the_config():
    import argparse

    from lmdeploy.cli.engine_args import add_engine_args, engine_config_from_args
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(
        ['--device', 'cpu', '--adapters', 'sql=/a/sql', '/a/chat', '--max-loras', '3', '--max-lora-rank', '16']))
    assert config.adapters == {'sql': '/a/sql', 'default': '/a/chat'}
    assert (config.max_loras, config.max_lora_rank) == (3, 16)
    assert engine_config_from_args(parser.parse_args(['--device', 'cpu'])).adapters is None
    with pytest.raises(ValueError, match='twice'):
        engine_config_from_args(parser.parse_args(['--device', 'cpu', '--adapters', '/a', '/b']))
