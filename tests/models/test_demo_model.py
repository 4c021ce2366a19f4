import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors import safe_open

from lmdeploy import demo_model
from lmdeploy.demo_model import (
    ENDOFTEXT,
    IM_END,
    IM_START,
    SPECIAL_TOKENS,
    TOKENIZER_VOCAB_SIZE,
    VISION_TOKENS,
    build_tokenizer,
    get_demo_model_path,
    save_tiny_model,
)

TEXTS = [
    'Hello world!',
    "It's 12:30 -- don't\r\n\r\n  go away   ",
    'Ünïcödé 日本語 😀\ttabs\nand {json: [1, 2]}',
    '',
]


def _safetensor_keys(path: str) -> list[str]:
    with safe_open(os.path.join(path, 'model.safetensors'), 'pt') as f:
        return list(f.keys())


def _load_model(path: str, arch: str):
    if arch == 'qwen3_5_vl':
        return transformers.Qwen3_5ForConditionalGeneration.from_pretrained(path)
    return transformers.AutoModelForCausalLM.from_pretrained(path)


@pytest.fixture(scope='module')
def tiny_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp('tiny')
    return {arch: save_tiny_model(str(root / arch), arch) for arch in demo_model.SUPPORTED_ARCHS}


EXPECTED_CLASSES = {
    'qwen3': 'Qwen3ForCausalLM',
    'qwen3_5': 'Qwen3_5ForCausalLM',
    'qwen3_next': 'Qwen3NextForCausalLM',
    'qwen3_5_vl': 'Qwen3_5ForConditionalGeneration',
}


@pytest.mark.parametrize('arch', demo_model.SUPPORTED_ARCHS)
def test_build_and_load(tiny_models, arch):
    path = tiny_models[arch]
    for name in ('config.json', 'generation_config.json', 'model.safetensors', 'tokenizer.json'):
        assert os.path.isfile(os.path.join(path, name)), name
    model = _load_model(path, arch)
    assert type(model).__name__ == EXPECTED_CLASSES[arch]
    assert model.dtype == torch.float32
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    text_config = model.config.get_text_config()
    assert text_config.vocab_size >= len(tokenizer)
    assert text_config.hidden_size == 64 and text_config.head_dim == 16
    ids = torch.tensor([tokenizer.encode('The quick brown fox')])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], text_config.vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize('arch', ['qwen3_5', 'qwen3_next', 'qwen3_5_vl'])
def test_hybrid_layer_types(tiny_models, arch):
    config = transformers.AutoConfig.from_pretrained(tiny_models[arch]).get_text_config()
    assert config.layer_types == ['linear_attention'] * 3 + ['full_attention']
    assert config.linear_num_key_heads == 2 and config.linear_num_value_heads == 4


def test_qwen3_next_moe_config(tiny_models):
    config = transformers.AutoConfig.from_pretrained(tiny_models['qwen3_next'])
    assert (config.num_experts, config.num_experts_per_tok) == (4, 2)
    assert config.mlp_only_layers == [] and config.decoder_sparse_step == 1
    keys = _safetensor_keys(tiny_models['qwen3_next'])
    assert 'model.layers.0.mlp.shared_expert_gate.weight' in keys
    assert any(k.startswith('model.layers.0.mlp.experts.') for k in keys)


def test_qwen3_5_vl_keys(tiny_models):
    keys = _safetensor_keys(tiny_models['qwen3_5_vl'])
    assert 'model.language_model.embed_tokens.weight' in keys
    assert 'model.language_model.layers.0.linear_attn.A_log' in keys
    assert 'model.language_model.layers.3.self_attn.q_proj.weight' in keys
    assert 'lm_head.weight' in keys
    assert any(k.startswith('model.visual.') for k in keys)
    assert not any(k.startswith('model.layers.') for k in keys)
    with open(os.path.join(tiny_models['qwen3_5_vl'], 'config.json')) as f:
        config = json.load(f)
    assert config['architectures'] == ['Qwen3_5ForConditionalGeneration']
    assert config['text_config']['num_hidden_layers'] == 4


def test_generation_config(tiny_models):
    tokenizer = build_tokenizer()
    gen = transformers.GenerationConfig.from_pretrained(tiny_models['qwen3'])
    assert gen.eos_token_id == tokenizer.convert_tokens_to_ids(IM_END)
    assert gen.pad_token_id == tokenizer.convert_tokens_to_ids(ENDOFTEXT)


def test_perturb_and_seed(tmp_path):
    def norm_weight(path):
        with safe_open(os.path.join(path, 'model.safetensors'), 'pt') as f:
            return f.get_tensor('model.layers.0.linear_attn.norm.weight')

    a = save_tiny_model(str(tmp_path / 'a'), 'qwen3_5', seed=1)
    b = save_tiny_model(str(tmp_path / 'b'), 'qwen3_5', seed=1)
    c = save_tiny_model(str(tmp_path / 'c'), 'qwen3_5', seed=1, perturb=False)
    assert torch.equal(norm_weight(a), norm_weight(b))
    assert not torch.equal(norm_weight(a), norm_weight(c))
    assert torch.equal(norm_weight(c), torch.ones_like(norm_weight(c)))


def test_overrides_and_dtype(tmp_path):
    path = save_tiny_model(str(tmp_path / 'm'), 'qwen3_next', config_overrides={'num_hidden_layers': 2,
                                                                               'full_attention_interval': 2},
                           dtype='bfloat16')
    config = transformers.AutoConfig.from_pretrained(path)
    assert config.layer_types == ['linear_attention', 'full_attention']
    with safe_open(os.path.join(path, 'model.safetensors'), 'pt') as f:
        assert f.get_tensor('model.embed_tokens.weight').dtype == torch.bfloat16
    with pytest.raises(ValueError):
        save_tiny_model(str(tmp_path / 'bad'), 'qwen3', config_overrides={'vocab_size': 10})


@pytest.mark.parametrize('arch', ['qwen3_5', 'qwen3_5_vl'])
def test_a_config_only_folder_has_the_checkpoints_config_and_no_weights(tmp_path, arch):
    overrides = {'num_hidden_layers': 8, 'hidden_size': 64}
    full = save_tiny_model(str(tmp_path / 'full'), arch, config_overrides=overrides, dtype='bfloat16')
    bare = save_tiny_model(str(tmp_path / 'bare'), arch, config_overrides=overrides, dtype='bfloat16', weights=False)
    assert not [f for f in os.listdir(bare) if f.endswith('.safetensors')]
    for name in ('config.json', 'generation_config.json'):
        with open(os.path.join(full, name)) as a, open(os.path.join(bare, name)) as b:
            assert json.load(a) == json.load(b), name
    assert build_tokenizer(arch).encode(TEXTS[2]) == transformers.AutoTokenizer.from_pretrained(bare).encode(TEXTS[2])


@pytest.mark.parametrize('arch', ['qwen3', 'qwen3_5_vl'])
def test_tokenizer_roundtrip(tiny_models, arch):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_models[arch])
    # vision-language checkpoints add the vision tokens after the text vocabulary
    num_vision = len(VISION_TOKENS) if arch == 'qwen3_5_vl' else 0
    assert len(tokenizer) == TOKENIZER_VOCAB_SIZE + num_vision
    if num_vision:
        assert tokenizer.convert_tokens_to_ids(list(VISION_TOKENS)) == list(range(TOKENIZER_VOCAB_SIZE,
                                                                                  len(tokenizer)))
    assert tokenizer.eos_token == IM_END and tokenizer.pad_token == ENDOFTEXT
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
        assert ids == build_tokenizer(arch).encode(text, add_special_tokens=False)
    sentence = 'the quick brown fox jumps over the lazy dog'
    assert len(tokenizer.encode(sentence)) < len(sentence) // 2  # BPE merges are actually used
    special_ids = tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    assert special_ids == [TOKENIZER_VOCAB_SIZE - 3, TOKENIZER_VOCAB_SIZE - 2, TOKENIZER_VOCAB_SIZE - 1]
    assert tokenizer.encode(f'{IM_START}user', add_special_tokens=False)[0] == special_ids[1]
    assert tokenizer.decode(special_ids + tokenizer.encode('hi'), skip_special_tokens=True) == 'hi'


def test_chat_template(tiny_models):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_models['qwen3'])
    messages = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi!'}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ('<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n'
                    '<|im_start|>assistant\n')
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert text.endswith('<|im_start|>user\nHi!<|im_end|>\n')
    parts = [{'role': 'user', 'content': [{'type': 'text', 'text': 'a'}, {'type': 'text', 'text': 'b'}]}]
    assert tokenizer.apply_chat_template(parts, tokenize=False) == '<|im_start|>user\nab<|im_end|>\n'


def test_tokenizer_training_deterministic():
    first = demo_model._train_tokenizer_json.__wrapped__(demo_model.QWEN2_PRETOKENIZE_REGEX, TOKENIZER_VOCAB_SIZE)
    second = demo_model._train_tokenizer_json.__wrapped__(demo_model.QWEN2_PRETOKENIZE_REGEX, TOKENIZER_VOCAB_SIZE)
    assert first == second
    # a fresh process (different hash seeds) must produce the same vocab and merges
    code = ('import hashlib; from lmdeploy import demo_model as d; '
            'print(hashlib.sha256(d._train_tokenizer_json(d.QWEN2_PRETOKENIZE_REGEX, 1024).encode()).hexdigest())')
    repo_root = os.path.dirname(os.path.dirname(os.path.abspath(demo_model.__file__)))
    pythonpath = os.pathsep.join(p for p in (repo_root, os.environ.get('PYTHONPATH')) if p)
    env = dict(os.environ, PYTHONHASHSEED='123', PYTHONPATH=pythonpath)
    out = subprocess.run([sys.executable, '-c', code], env=env, check=True, capture_output=True, text=True)
    assert out.stdout.strip() == hashlib.sha256(first.encode()).hexdigest()


def test_get_demo_model_path(tmp_path, monkeypatch):
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path))
    path = get_demo_model_path('qwen3')
    assert path == os.path.join(str(tmp_path), 'demo-qwen3-v1')
    assert os.path.isfile(os.path.join(path, 'model.safetensors'))
    mtime = os.path.getmtime(os.path.join(path, 'model.safetensors'))
    assert get_demo_model_path('qwen3') == path
    assert os.path.getmtime(os.path.join(path, 'model.safetensors')) == mtime
    assert sorted(os.listdir(tmp_path)) == ['demo-qwen3-v1']  # no temp dirs left behind
    config = transformers.AutoConfig.from_pretrained(path)
    assert config.hidden_size == 128 and config.head_dim == 32


def test_get_demo_model_path_lost_race(tmp_path, monkeypatch):
    """If another process renamed its folder first, ours is discarded and theirs is used."""
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path))
    target = tmp_path / 'demo-qwen3-v1'
    real_save = demo_model.save_tiny_model

    def racing_save(path, **kwargs):
        real_save(path, **kwargs)
        target.mkdir()
        (target / 'config.json').write_text('{}')
        (target / 'theirs').write_text('x')
        return path

    monkeypatch.setattr(demo_model, 'save_tiny_model', racing_save)
    assert get_demo_model_path('qwen3') == str(target)
    assert (target / 'theirs').exists()
    assert sorted(os.listdir(tmp_path)) == ['demo-qwen3-v1']


def test_unknown_arch(tmp_path):
    with pytest.raises(ValueError):
        save_tiny_model(str(tmp_path / 'x'), 'llama')
