"""Checkpoint loading: the parallel shard reader, strictness (unused tensors, unloaded parameters, the ignore
list), every expert layout loading to identical parameters, dummy weights, and the weight memory estimate."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lmdeploy.pytorch.models import checkpoint as ckpt_mod
from lmdeploy.pytorch.models import loader
from lmdeploy.pytorch.models.checkpoint import Checkpoint

transformers = pytest.importorskip('transformers')
LIN, FULL = 'linear_attention', 'full_attention'
MOE_35 = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, layer_types=[LIN, FULL], num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=32,
              max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False)


def build(path: str, device: str = 'cpu', **kwargs):
    return loader.build_model(path, torch.device(device), 'float32', device, **kwargs)[0]


def params_of(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def rewrite(src: str, dst: str, edit) -> str:
    """Copy the checkpoint folder `src` to `dst`, passing its tensors through `edit(dict) -> dict`."""
    shutil.copytree(src, dst)
    file = os.path.join(dst, 'model.safetensors')
    tensors = edit(load_file(file))
    save_file(tensors, file, metadata={'format': 'pt'})
    return dst


def shard(src: str, dst: str, num_shards: int) -> str:
    """Split a single-file checkpoint into `num_shards` files with a `model.safetensors.index.json`."""
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(dst, 'model.safetensors'))
    os.remove(os.path.join(dst, 'model.safetensors'))
    names = sorted(tensors)
    weight_map = {}
    for i in range(num_shards):
        file = f'model-{i + 1:05d}-of-{num_shards:05d}.safetensors'
        part = {n: tensors[n] for n in names[i::num_shards]}
        save_file(part, os.path.join(dst, file), metadata={'format': 'pt'})
        weight_map.update(dict.fromkeys(part, file))
    with open(os.path.join(dst, 'model.safetensors.index.json'), 'w') as f:
        json.dump({'metadata': {}, 'weight_map': weight_map}, f)
    return dst


@pytest.fixture(scope='module')
def qwen3_5(tiny_model_factory):
    return tiny_model_factory('qwen3_5', num_hidden_layers=2, layer_types=[LIN, FULL])


@pytest.fixture(scope='module')
def moe_checkpoint(tmp_path_factory):
    """A tiny Qwen3.5-MoE checkpoint saved by transformers (per-expert keys)."""
    from lmdeploy import demo_model
    path = str(tmp_path_factory.mktemp('moe'))
    torch.manual_seed(0)
    model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**MOE_35)).eval()
    demo_model._perturb_(model)
    model.save_pretrained(path)
    return path


# ---- the reader ----------------------------------------------------------------------------------------------
def test_sharded_reader_yields_every_tensor_once_within_the_byte_budget(qwen3_5, tmp_path, monkeypatch):
    path = shard(qwen3_5, str(tmp_path / 'sharded'), 3)
    expected = load_file(os.path.join(qwen3_5, 'model.safetensors'))
    peaks = []

    class Recording(ckpt_mod._ByteBudget):
        def acquire(self, nbytes, stop):
            ok = super().acquire(nbytes, stop)
            peaks.append(self._used)
            return ok
    monkeypatch.setattr(ckpt_mod, '_ByteBudget', Recording)
    budget = 64 << 10
    largest = max(t.numel() * t.element_size() for t in expected.values())
    seen = {}
    for name, tensor in Checkpoint(path).iter_tensors(num_workers=3, budget_bytes=budget, progress=False):
        assert name not in seen
        seen[name] = tensor.clone()
    assert seen.keys() == expected.keys()
    assert all(torch.equal(seen[n], expected[n]) for n in expected)
    # read-but-unconsumed bytes never exceed the budget, except one tensor larger than it, read alone
    assert max(peaks) <= max(budget, largest)
    assert len(peaks) == len(expected)


def test_sharded_checkpoint_loads_the_same_parameters_as_one_file(qwen3_5, tmp_path):
    whole, sharded = params_of(build(qwen3_5)), params_of(build(shard(qwen3_5, str(tmp_path / 's'), 4)))
    assert whole.keys() == sharded.keys() and all(torch.equal(whole[n], sharded[n]) for n in whole)


def test_index_naming_a_missing_shard_is_refused(qwen3_5, tmp_path):
    path = shard(qwen3_5, str(tmp_path / 's'), 2)
    os.remove(os.path.join(path, 'model-00002-of-00002.safetensors'))
    with pytest.raises(ValueError, match='missing.*model-00002-of-00002'):
        build(path)


# ---- strictness ------------------------------------------------------------------------------------------------
def test_a_tensor_the_model_does_not_use_is_refused_by_name(qwen3_5, tmp_path):
    path = rewrite(qwen3_5, str(tmp_path / 'extra'), lambda t: {
        **t, 'model.layers.0.linear_attn.extra_proj.weight': torch.zeros(4, 4), 'model.foo': torch.zeros(2)})
    with pytest.raises(ValueError, match=r"does not use: \['model.foo', 'model.layers.0.linear_attn.extra_proj"):
        build(path)


def test_a_parameter_the_checkpoint_lacks_is_refused_by_name(qwen3_5, tmp_path):
    def drop(tensors):
        del tensors['model.layers.1.self_attn.k_proj.weight']
        del tensors['model.norm.weight']
        return tensors
    # k_proj is shard 1 of the fused qkv_proj: the other shards loading does not hide it
    with pytest.raises(ValueError, match=r"does not provide: \['model.layers.1.self_attn.qkv_proj.weight#1', "
                                         r"'model.norm.weight'\] \(2 in all\)"):
        build(rewrite(qwen3_5, str(tmp_path / 'missing'), drop))


def test_a_missing_expert_projection_is_refused_by_name(moe_checkpoint, tmp_path):
    def drop(tensors):
        del tensors['model.layers.1.mlp.experts.3.up_proj.weight']
        return tensors
    with pytest.raises(ValueError, match=r"does not provide: \['model.layers.1.mlp.experts.gate_up_proj#3.up_proj'\]"):
        build(rewrite(moe_checkpoint, str(tmp_path / 'missing'), drop))


def test_mtp_tensors_are_the_only_ones_ignored(qwen3_5, tmp_path):
    from lmdeploy.pytorch.models.weight_loading import IGNORED_CHECKPOINT_PREFIXES
    assert set(IGNORED_CHECKPOINT_PREFIXES) == {'mtp.'}
    path = rewrite(qwen3_5, str(tmp_path / 'mtp'), lambda t: {
        **t, 'mtp.fc.weight': torch.zeros(64, 128), 'mtp.layers.0.input_layernorm.weight': torch.zeros(64)})
    loaded = params_of(build(path))
    reference = params_of(build(qwen3_5))
    assert all(torch.equal(loaded[n], reference[n]) for n in reference)


# ---- expert layouts ----------------------------------------------------------------------------------------------
def _fuse_experts(tensors: dict, transpose: bool = False) -> dict:
    fused: dict = {}
    for name in [n for n in tensors if '.experts.' in n]:
        prefix, key = name.split('.experts.')
        expert_id, proj, _ = key.split('.')
        fused.setdefault(prefix, {}).setdefault(int(expert_id), {})[proj] = tensors.pop(name)
    for prefix, experts in fused.items():
        order = sorted(experts)
        gate_up = torch.stack([torch.cat([experts[e]['gate_proj'], experts[e]['up_proj']]) for e in order])
        down = torch.stack([experts[e]['down_proj'] for e in order])
        if transpose:
            gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
        tensors[f'{prefix}.experts.gate_up_proj'] = gate_up
        tensors[f'{prefix}.experts.down_proj'] = down
    return tensors


def _as_vl(tensors: dict) -> dict:
    return {('model.language_model.' + n[len('model.'):] if n.startswith('model.') else n): t
            for n, t in tensors.items()}


@pytest.mark.parametrize('layout', ['fused', 'fused_transposed', 'vl_fused'])
def test_every_expert_layout_loads_identical_parameters(moe_checkpoint, tmp_path, layout):
    def edit(tensors):
        tensors = _fuse_experts(tensors, transpose=layout == 'fused_transposed')
        return _as_vl(tensors) if layout.startswith('vl') else tensors
    path = rewrite(moe_checkpoint, str(tmp_path / layout), edit)
    per_expert, other = params_of(build(moe_checkpoint)), params_of(build(path))
    assert per_expert.keys() == other.keys()
    assert all(torch.equal(per_expert[n], other[n]) for n in per_expert)


# ---- dummy weights and the memory estimate ------------------------------------------------------------------------
def test_dummy_weights_need_only_config_json_and_have_every_shape(qwen3_5, tmp_path):
    folder = tmp_path / 'config-only'
    folder.mkdir()
    shutil.copy(os.path.join(qwen3_5, 'config.json'), folder)
    dummy, real = build(str(folder), load_format='dummy'), build(qwen3_5)
    shapes = {n: (p.shape, p.dtype) for n, p in dummy.named_parameters()}
    assert shapes == {n: (p.shape, p.dtype) for n, p in real.named_parameters()}
    for name, p in dummy.named_parameters():
        assert p.abs().max() <= 1e-3 and p.std() > 0, name
    again = params_of(build(str(folder), load_format='dummy'))
    assert all(torch.equal(again[n], p) for n, p in dummy.named_parameters())  # seeded


def test_weights_larger_than_free_memory_are_refused_before_allocating(monkeypatch):
    monkeypatch.setattr(torch.cuda, 'mem_get_info', lambda device=None: (10 << 30, 80 << 30))
    with pytest.raises(ValueError, match=r'need 12.0 GiB but cuda:0 has 10.0 GiB free \(of 80.0 GiB\)'):
        loader.check_weights_fit(12 << 30, torch.device('cuda', 0))
    loader.check_weights_fit(9 << 30, torch.device('cuda', 0))


def test_dummy_weights_serve_with_a_tokenizer_from_another_folder(qwen3_5, tmp_path):
    from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline
    folder = tmp_path / 'config-only'
    folder.mkdir()
    shutil.copy(os.path.join(qwen3_5, 'config.json'), folder)
    config = PytorchEngineConfig(device_type='cpu', num_gpu_blocks=16, load_format='dummy', tokenizer=qwen3_5)
    with pipeline(str(folder), config) as pipe:
        response = pipe('hello there', GenerationConfig(max_new_tokens=4, ignore_eos=True))
    assert len(response.token_ids) == 4


def test_engine_flags_reach_the_config():
    import argparse

    from lmdeploy.cli.engine_args import add_engine_args, engine_config_from_args
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(['--load-format', 'dummy', '--tokenizer', '/tok', '--revision', 'v2',
                              '--download-dir', '/cache', '--device', 'cpu'])
    config = engine_config_from_args(args)
    assert (config.load_format, config.tokenizer, config.revision, config.download_dir) == \
        ('dummy', '/tok', 'v2', '/cache')
    from lmdeploy.messages import PytorchEngineConfig
    with pytest.raises(ValueError, match='load_format must be one of'):
        PytorchEngineConfig(device_type='cpu', load_format='pt')


def test_reader_stops_its_threads_when_closed_early_and_reports_a_corrupt_shard(qwen3_5, tmp_path):
    import threading
    path = shard(qwen3_5, str(tmp_path / 's'), 3)
    tensors = Checkpoint(path).iter_tensors(num_workers=3, budget_bytes=1, progress=False)
    next(tensors)
    tensors.close()
    assert not [t for t in threading.enumerate() if t.name.startswith('lmdeploy-load')]
    victim = os.path.join(path, 'model-00002-of-00003.safetensors')
    with open(victim, 'r+b') as f:  # keep the header, cut the data
        length = int.from_bytes(f.read(8), 'little')
        f.truncate(8 + length + 16)
    with pytest.raises(Exception, match='(?i)incomplete|invalid|out of bounds|metadata|size'):
        for _ in Checkpoint(path).iter_tensors(progress=False):
            pass
    assert not [t for t in threading.enumerate() if t.name.startswith('lmdeploy-load')]
