"""Hybrid models (gated DeltaNet + gated full attention) on the CPU engine, against transformers as the reference.

Tiny random-weight checkpoints (n_v_heads > n_k_heads unless noted) cover Qwen3.5, the Qwen3.5 vision-language
layout, Qwen3-Next (MoE + dense layers, both rope config layouts) and Qwen3.5-MoE (per-expert and fused expert keys).
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

import pytest
import torch
from engines import engine_factory
from numeric import assert_close

from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.messages import SamplingParams

transformers = pytest.importorskip('transformers')
demo_model = pytest.importorskip('lmdeploy.demo_model')

ATOL = 1e-4          # float32 logits
GAP = 1e-3           # greedy tokens are compared where the reference's top-2 gap exceeds this
LIN, FULL = 'linear_attention', 'full_attention'


@dataclass(frozen=True)
class Case:
    arch: str
    overrides: dict
    legacy_rope: bool = False  # move rope settings to the top level of config.json, like older checkpoints


CASES = {
    'qwen3_5': Case('qwen3_5', dict(num_hidden_layers=4, layer_types=[LIN, FULL, LIN, LIN])),
    'qwen3_5_vl': Case('qwen3_5_vl', dict(num_hidden_layers=2, layer_types=[FULL, LIN])),
    'qwen3_next': Case('qwen3_next', dict(num_hidden_layers=4, layer_types=[LIN, FULL, LIN, LIN], mlp_only_layers=[2])),
    # n_v_heads == n_k_heads, dense layer 0 via decoder_sparse_step, rope_theta / partial_rotary_factor at top level
    'qwen3_next_legacy': Case('qwen3_next', dict(num_hidden_layers=2, layer_types=[FULL, LIN], decoder_sparse_step=2,
                                                 linear_num_value_heads=2), legacy_rope=True),
}


def _move_rope_to_top_level(path: str) -> None:
    config_file = os.path.join(path, 'config.json')
    with open(config_file) as f:
        config = json.load(f)
    rope = config.pop('rope_parameters')
    config['rope_theta'] = rope['rope_theta']
    config['partial_rotary_factor'] = rope['partial_rotary_factor']
    with open(config_file, 'w') as f:
        json.dump(config, f)


def _load_reference(path: str, arch: str) -> torch.nn.Module:
    cls = transformers.Qwen3_5ForConditionalGeneration if arch == 'qwen3_5_vl' else transformers.AutoModelForCausalLM
    return cls.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope='module')
def checkpoints(tiny_model_factory, tmp_path_factory):
    """name -> (checkpoint folder, transformers model), built on first use."""
    built = {}

    def get(name: str) -> tuple[str, torch.nn.Module]:
        if name not in built:
            case = CASES[name]
            path = tiny_model_factory(case.arch, **case.overrides)
            if case.legacy_rope:  # edit a private copy: the factory's folders are shared by the session
                path = shutil.copytree(path, tmp_path_factory.mktemp(name), dirs_exist_ok=True)
                _move_rope_to_top_level(path)
            built[name] = str(path), _load_reference(str(path), case.arch)
        return built[name]
    return get


# ---- helpers ------------------------------------------------------------------------------------------------------
make_engine = engine_factory(block_size=16, kernel_block_size=8, num_gpu_blocks=64, max_batch_size=8,
                             max_prefill_token_num=256)


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 1000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_checked(engine: Engine) -> None:
    """Step until idle, checking the block / slot accounting after every step."""
    while engine.has_work:
        engine.step()
        engine.check_integrity()
    assert_all_free(engine)


def assert_all_free(engine: Engine) -> None:
    engine.check_integrity()
    states = engine.scheduler.state_manager
    assert states.num_free == states.num_usable
    assert engine.scheduler.block_manager.num_free == engine.cache_config.num_blocks


def record_batches(engine: Engine) -> list[list[int]]:
    """Make `engine` log the new-token counts (`q_lens`) of every forward it runs; returns the log."""
    batches: list[list[int]] = []
    make = engine.inputs_maker.make

    def recording_make(sched):
        inputs, sampled = make(sched)
        batches.append(list(inputs.q_lens_list))
        return inputs, sampled
    engine.inputs_maker.make = recording_make
    return batches


@dataclass
class Result:
    token_ids: list[int]       # prompt + generated
    logits: torch.Tensor       # [num_fed, vocab]: logits of every token fed (prompt + generated[:-1])


def generate(engine: Engine, prompts: list[list[int]], max_new_tokens: int) -> list[Result]:
    """Queue all prompts at once, run to idle, return each request's tokens and teacher-forced logits."""
    outputs: dict[int, list[int]] = {}
    ids = []
    for token_ids in prompts:
        seq_id = engine.add_request(token_ids, SamplingParams(max_new_tokens=max_new_tokens), collect_logits=True,
                                    callback=lambda out: outputs.setdefault(out.seq_id, []).extend(out.new_token_ids))
        ids.append(seq_id)
    run_checked(engine)
    return [Result(p + outputs[i], engine.pop_collected_logits(i)) for p, i in zip(prompts, ids)]


@torch.no_grad()
def reference_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([token_ids]), use_cache=False).logits[0].float()


def assert_matches_reference(model: torch.nn.Module, result: Result, num_prompt: int) -> None:
    fed = result.token_ids[:-1]
    ref = reference_logits(model, fed)
    assert_close(result.logits, ref, atol=ATOL, rtol=0, what='logits')
    top2 = ref.topk(2, dim=-1).values
    for pos in range(num_prompt - 1, len(fed)):
        if top2[pos, 0] - top2[pos, 1] > GAP:
            assert result.token_ids[pos + 1] == int(ref[pos].argmax()), f'greedy token {pos + 1} differs'


# ---- logits against transformers --------------------------------------------------------------------------------
@pytest.mark.parametrize('name', list(CASES))
def test_teacher_forced_logits_match_transformers(checkpoints, name):
    path, model = checkpoints(name)
    engine = make_engine(path)
    prompts = [prompt(23, seed=1), prompt(6, seed=2), prompt(1, seed=3)]
    for p, result in zip(prompts, generate(engine, prompts, max_new_tokens=6)):
        assert len(result.token_ids) == len(p) + 6
        assert_matches_reference(model, result, len(p))


def _per_layer_hidden_states(self, ctx):
    """`HybridModel.hidden_states` with every residual add done by its own layer (`HybridDecoderLayer.forward`)."""
    inputs = ctx.inputs
    x = self.embed_tokens(inputs.input_ids)
    cos_sin = self.rotary_emb.cos_sin(inputs.position_ids)
    for layer in self.layers:
        x = layer(x, self.rotary_emb, cos_sin, ctx)
    return x


@pytest.mark.parametrize('name', ['qwen3_5', 'qwen3_next'])
def test_residual_adds_fused_into_the_next_norm_are_bit_identical(checkpoints, name, monkeypatch):
    """In bf16 the model forward (each layer's residual add inside the next layer's input norm) gives the logits
    of adding the residual inside each layer, bit for bit: the same sums in the same dtype."""
    from lmdeploy.pytorch.models.qwen3_next import HybridModel
    path, _ = checkpoints(name)
    prompts = [prompt(23, seed=1), prompt(6, seed=2)]
    fused = generate(make_engine(path, dtype='bfloat16'), prompts, max_new_tokens=3)
    monkeypatch.setattr(HybridModel, 'hidden_states', _per_layer_hidden_states)
    per_layer = generate(make_engine(path, dtype='bfloat16'), prompts, max_new_tokens=3)
    for a, b in zip(fused, per_layer):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=0)


def test_model_config_lays_out_kv_and_state(checkpoints):
    path, _ = checkpoints('qwen3_5')
    config = make_engine(path).model_config
    assert config.attn_layer_ids == (1,) and config.recurrent_layer_ids == (0, 2, 3)
    conv, recurrent = config.state_specs
    # conv channels = 2 * key_dim + value_dim = 2 * 2 * 16 + 4 * 16; recurrent is [n_v_heads, d_k, d_v] in float32
    assert (conv.name, conv.shape, conv.dtype) == ('conv', (128, 3), 'float32')
    assert (recurrent.name, recurrent.shape, recurrent.dtype) == ('recurrent', (4, 16, 16), 'float32')


# ---- chunked prefill, mixed batches, preemption -----------------------------------------------------------------
@pytest.mark.parametrize('chunk,lengths', [(5, (11, 12, 13)), (7, (15, 9, 10))], ids=['chunk5', 'chunk7'])
def test_chunked_prefill_equals_unchunked(checkpoints, chunk, lengths):
    # final prefill pieces of 1, 2 and 3 tokens (a 1-token piece runs the recurrent decode path)
    path, model = checkpoints('qwen3_5')
    whole, chunked = make_engine(path), make_engine(path, max_prefill_token_num=chunk, kernel_block_size=4)
    batches = record_batches(chunked)
    for seed, length in enumerate(lengths):
        p = prompt(length, seed=10 + seed)
        del batches[:]
        (expected,), (actual,) = generate(whole, [p], 3), generate(chunked, [p], 3)
        pieces = [q for q, in batches][:-2]  # drop the two decode steps
        assert pieces == [chunk] * (length // chunk) + [length % chunk], pieces
        assert actual.token_ids == expected.token_ids
        assert_close(actual.logits, expected.logits, atol=5e-5, rtol=0)
        assert_matches_reference(model, actual, length)


def test_mixed_prefill_and_decode_batch_equals_each_alone(checkpoints):
    path, model = checkpoints('qwen3_next')
    engine = make_engine(path, max_prefill_token_num=8)
    prompts = [prompt(9, seed=20), prompt(13, seed=21), prompt(4, seed=22)]
    alone = [generate(engine, [p], 5)[0] for p in prompts]

    batches = record_batches(engine)
    outputs: dict[int, list[int]] = {}

    def callback(out):
        outputs.setdefault(out.seq_id, []).extend(out.new_token_ids)
    first = engine.add_request(prompts[0], SamplingParams(max_new_tokens=5), callback=callback, collect_logits=True)
    engine.step()   # prompt 0 prefills 8 tokens
    engine.step()   # ... and its last one (a 1-token piece), sampling its first token
    later = [engine.add_request(p, SamplingParams(max_new_tokens=5), callback=callback, collect_logits=True)
             for p in prompts[1:]]
    run_checked(engine)

    assert any(1 in q and max(q) > 1 for q in batches), f'no mixed prefill/decode batch: {batches}'
    assert any(len(q) > 1 and max(q) == 1 for q in batches), f'no batched decode: {batches}'
    for p, seq_id, expected in zip(prompts, [first, *later], alone):
        assert p + outputs[seq_id] == expected.token_ids
        assert_close(engine.pop_collected_logits(seq_id), expected.logits, atol=5e-5, rtol=0)
    for p, expected in zip(prompts, alone):
        assert_matches_reference(model, expected, len(p))


def test_preemption_gives_the_same_tokens(checkpoints):
    path, _ = checkpoints('qwen3_5')
    prompts = [prompt(10, seed=30 + i) for i in range(3)]
    expected = [r.token_ids for r in generate(make_engine(path, block_size=8), prompts, 12)]

    # 6 blocks of 8 tokens: all three are admitted (2 blocks each), then growing past 16 tokens forces preemption.
    engine = make_engine(path, block_size=8, kernel_block_size=4, num_gpu_blocks=6)
    outputs: dict[int, list[int]] = {}
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=12),
                              callback=lambda out: outputs.setdefault(out.seq_id, []).extend(out.new_token_ids))
           for p in prompts]
    engine.step()
    seqs = list(engine.scheduler.running)
    run_checked(engine)
    assert sum(seq.num_preemptions for seq in seqs) > 0
    assert [p + outputs[i] for p, i in zip(prompts, ids)] == expected


# ---- recurrent state against transformers' cache ----------------------------------------------------------------
def _hf_cache(output):
    for name in ('cache', 'past_key_values'):
        cache = getattr(output, name, None)
        if cache is not None:
            return cache
    raise AssertionError('transformers returned no cache')


def _hf_linear_states(cache, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(conv [C, K], recurrent [H, Dk, Dv]) of batch row 0 for one DeltaNet layer, across cache layouts."""
    layers = getattr(cache, 'layers', None)
    if layers is not None and hasattr(layers[layer_id], 'conv_states'):
        conv, recurrent = layers[layer_id].conv_states, layers[layer_id].recurrent_states
    else:
        conv, recurrent = cache.conv_states[layer_id], cache.recurrent_states[layer_id]
    if isinstance(conv, dict):
        conv, recurrent = conv[0], recurrent[0]
    return conv[0], recurrent[0]


@pytest.mark.parametrize('name', ['qwen3_5', 'qwen3_next'])
def test_engine_state_equals_transformers_cache(checkpoints, name):
    path, model = checkpoints(name)
    engine = make_engine(path, max_prefill_token_num=5)
    config = engine.model_config
    p = prompt(13, seed=40)
    engine.add_request(p, SamplingParams(max_new_tokens=6))
    compared = []
    while engine.has_work:
        engine.step()
        engine.check_integrity()
        if not engine.scheduler.running:
            continue
        seq = engine.scheduler.running[0]
        if seq.num_computed not in (5, 13, 16):   # mid-prefill, after prefill, after 3 decodes
            continue
        with torch.no_grad():
            cache = _hf_cache(model(input_ids=torch.tensor([seq.token_ids[:seq.num_computed]]), use_cache=True))
        for index, layer_id in enumerate(config.recurrent_layer_ids):
            states = engine.cache_engine.state_caches[index]
            ref_conv, ref_recurrent = _hf_linear_states(cache, layer_id)
            kernel_size = ref_conv.size(-1)
            assert_close(states['conv'][seq.state_slot], ref_conv[..., -(kernel_size - 1):],
                         atol=1e-5, rtol=0, what=f'conv state of layer {layer_id}')
            assert_close(states['recurrent'][seq.state_slot], ref_recurrent, atol=1e-5, rtol=0,
                         what=f'recurrent state of layer {layer_id}')
        compared.append(seq.num_computed)
    assert compared == [5, 13, 16]
    assert_all_free(engine)


# ---- Qwen3.5-MoE: per-expert and fused expert checkpoints ---------------------------------------------------------
def _fuse_experts(path: str) -> None:
    """Rewrite per-expert keys as transformers' fused `experts.gate_up_proj` [E, 2I, H] / `experts.down_proj`."""
    from safetensors.torch import load_file, save_file
    file = os.path.join(path, 'model.safetensors')
    tensors = load_file(file)
    fused: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name in [n for n in tensors if '.experts.' in n]:
        prefix, key = name.split('.experts.')
        expert_id, proj, _ = key.split('.')
        fused.setdefault(prefix, {}).setdefault(int(expert_id), {})[proj] = tensors.pop(name)
    for prefix, experts in fused.items():
        order = sorted(experts)
        tensors[f'{prefix}.experts.gate_up_proj'] = torch.stack(
            [torch.cat([experts[e]['gate_proj'], experts[e]['up_proj']]) for e in order])
        tensors[f'{prefix}.experts.down_proj'] = torch.stack([experts[e]['down_proj'] for e in order])
    save_file(tensors, file, metadata={'format': 'pt'})


@pytest.mark.parametrize('fused', [False, True], ids=['per_expert', 'fused'])
def test_qwen3_5_moe_matches_transformers(tmp_path, fused):
    config = transformers.Qwen3_5MoeTextConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, layer_types=[LIN, FULL], num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen3_5MoeForCausalLM(config).eval()
    demo_model._perturb_(model)
    model.generation_config.eos_token_id = None
    model.save_pretrained(str(tmp_path))
    if fused:
        _fuse_experts(str(tmp_path))
    p = prompt(17, seed=50)
    result, = generate(make_engine(str(tmp_path), max_prefill_token_num=7), [[t % 256 for t in p]], 4)
    assert_matches_reference(model, result, len(p))
