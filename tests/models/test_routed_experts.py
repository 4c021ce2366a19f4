"""Routed experts (the top-k expert ids every MoE layer routes each token to), against transformers.

Reference: transformers' forward with `output_router_logits=True` returns `[tokens, num_experts]` router logits per
MoE layer; their top-k is the set of experts the token was routed to. Sets are compared per token and layer, except
where the k-th and (k+1)-th logits are a near-tie (float32 rounding may then pick either expert).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.backends.selector import get_backend
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.engine.model_agent import ModelAgent
from lmdeploy.pytorch.messages import SamplingParams, SchedulerSequence

transformers = pytest.importorskip('transformers')
demo_model = pytest.importorskip('lmdeploy.demo_model')

LIN, FULL = 'linear_attention', 'full_attention'
TIE = 1e-4  # router logits closer than this at the top-k boundary are a near-tie: not compared


def make_engine(path: str, **overrides) -> Engine:
    config = dict(device_type='cpu', block_size=16, kernel_block_size=8, num_gpu_blocks=64, max_batch_size=8,
                  max_prefill_token_num=256)
    config.update(overrides)
    return Engine(path, PytorchEngineConfig(**config))


def prompt(length: int, seed: int, vocab: int = 1000) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope='module')
def qwen3_next(tiny_model_factory):
    """Qwen3-Next with MoE layers 0, 1, 3 and a dense MLP in layer 2."""
    path = tiny_model_factory('qwen3_next', num_hidden_layers=4, layer_types=[LIN, FULL, LIN, LIN],
                              mlp_only_layers=[2])
    return path, transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope='module')
def qwen3_5_moe(tmp_path_factory):
    config = transformers.Qwen3_5MoeTextConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=3, layer_types=[LIN, FULL, LIN], num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8,
        num_experts_per_tok=3, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen3_5MoeForCausalLM(config).eval()
    demo_model._perturb_(model)
    model.generation_config.eos_token_id = None
    path = str(tmp_path_factory.mktemp('qwen3_5_moe'))
    model.save_pretrained(path)
    return path, model


@torch.no_grad()
def reference_routes(model: torch.nn.Module, token_ids: list[int]) -> list[torch.Tensor]:
    """Router logits [T, E] of every MoE layer, in layer order."""
    out = model(input_ids=torch.tensor([token_ids]), output_router_logits=True, use_cache=False)
    return [logits.reshape(len(token_ids), -1).float() for logits in out.router_logits]


def assert_routes_match(routes: np.ndarray, ref_logits: list[torch.Tensor], top_k: int) -> int:
    """`routes` [T, L, k] against the top-k of each layer's router logits; returns the number of compared sets."""
    assert routes.dtype == np.uint16 and routes.shape == (ref_logits[0].size(0), len(ref_logits), top_k)
    compared = 0
    for layer, logits in enumerate(ref_logits):
        values, ids = logits.topk(top_k + 1, dim=-1)
        for t in range(logits.size(0)):
            if values[t, top_k - 1] - values[t, top_k] < TIE:
                continue
            assert set(routes[t, layer].tolist()) == set(ids[t, :top_k].tolist()), f'token {t}, MoE layer {layer}'
            compared += 1
    return compared


def forward_recording(engine: Engine, prompts: list[list[int]]) -> list[np.ndarray]:
    """One packed forward of all prompts through a ModelAgent that records routed experts; rows per prompt."""
    agent = ModelAgent(engine.model, engine.cache_engine, get_backend('cpu'), engine.device,
                       record_routed_experts=True)
    seqs = [SchedulerSequence(seq_id=i + 1, token_ids=list(p), num_prompt_tokens=len(p),
                              sampling=SamplingParams(max_new_tokens=1)) for i, p in enumerate(prompts)]
    for seq in seqs:
        engine.scheduler.add(seq)
    sched = engine.scheduler.schedule()
    assert sched.seqs == seqs and sched.num_new_tokens == [len(p) for p in prompts]
    inputs, _ = engine.inputs_maker.make(sched)
    inputs.record_routed_experts = True
    _, routes = agent.forward_logits(inputs)
    bounds = np.cumsum([0] + [len(p) for p in prompts])
    return [routes[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


@pytest.mark.parametrize('name', ['qwen3_next', 'qwen3_5_moe'])
def test_moe_layers_record_the_router_top_k_of_transformers(request, name):
    path, model = request.getfixturevalue(name)
    engine = make_engine(path)
    config = engine.model_config
    vocab = config.vocab_size
    prompts = [prompt(23, seed=1, vocab=vocab), prompt(6, seed=2, vocab=vocab), prompt(1, seed=3, vocab=vocab)]
    compared = 0
    for p, routes in zip(prompts, forward_recording(engine, prompts)):
        compared += assert_routes_match(routes, reference_routes(model, p), config.moe_top_k)
    assert compared > 0.8 * 30 * config.num_moe_layers  # near-ties are rare


def test_only_moe_layers_have_a_routes_column(qwen3_next, tiny_model_factory):
    path, _ = qwen3_next
    config = make_engine(path).model_config
    assert config.moe_layer_ids == (0, 1, 3) and config.moe_top_k == 2
    dense = make_engine(tiny_model_factory('qwen3_5')).model_config
    assert dense.moe_layer_ids == () and dense.num_moe_layers == 0


def test_a_forward_that_does_not_ask_records_nothing(qwen3_next):
    path, _ = qwen3_next
    engine = make_engine(path)
    agent = ModelAgent(engine.model, engine.cache_engine, get_backend('cpu'), engine.device,
                       record_routed_experts=True)
    seq = SchedulerSequence(seq_id=1, token_ids=prompt(5, seed=4), num_prompt_tokens=5,
                            sampling=SamplingParams(max_new_tokens=1))
    engine.scheduler.add(seq)
    inputs, _ = engine.inputs_maker.make(engine.scheduler.schedule())
    _, routes = agent.forward_logits(inputs)
    assert routes is None


def test_an_agent_without_the_flag_refuses_to_record(qwen3_next):
    path, _ = qwen3_next
    engine = make_engine(path)
    seq = SchedulerSequence(seq_id=1, token_ids=prompt(5, seed=4), num_prompt_tokens=5,
                            sampling=SamplingParams(max_new_tokens=1))
    engine.scheduler.add(seq)
    inputs, _ = engine.inputs_maker.make(engine.scheduler.schedule())
    inputs.record_routed_experts = True
    with pytest.raises(ValueError, match='enable_return_routed_experts'):
        engine.agent.forward_logits(inputs)
