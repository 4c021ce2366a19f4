"""Routed experts on the model side: the MoE layers record the top-k expert ids every token is routed to, against
transformers' router logits (see `routes_reference.py`), through a `ModelAgent` forward."""
from __future__ import annotations

import numpy as np
import pytest
from engines import engine_factory
from routes_reference import assert_routes_match, build_qwen3_5_moe, build_qwen3_next, prompt, reference_routes

from lmdeploy.pytorch.backends.selector import get_backend
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.engine.model_agent import ModelAgent
from lmdeploy.pytorch.messages import SamplingParams, SchedulerSequence

make_engine = engine_factory(block_size=16, kernel_block_size=8, num_gpu_blocks=64, max_batch_size=8,
                             max_prefill_token_num=256)


@pytest.fixture(scope='module')
def qwen3_next(tiny_model_factory):
    return build_qwen3_next(tiny_model_factory)


@pytest.fixture(scope='module')
def qwen3_5_moe(tmp_path_factory):
    return build_qwen3_5_moe(str(tmp_path_factory.mktemp('qwen3_5_moe')))


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
