"""LoRA adapters through the user surfaces: the OpenAI server (`model` names the adapter, `/v1/models` lists base +
adapters, an unknown name is a 404 for that request only) driven by the official `openai` client, and the
pipeline (`GenerationConfig.adapter_name`). A hybrid tiny model with prefix caching: turn 2 of a chat under an
adapter is served from that adapter's cache (`cached_tokens`), never from another adapter's."""
from __future__ import annotations

import openai
import pytest
from live_server import live_server
from lora_folders import write_model_adapter

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig, UnknownAdapterError
from lmdeploy.serve.async_engine import AsyncEngine
from lmdeploy.serve.openai.api_server import create_app
from lmdeploy.serve.pipeline import Pipeline

MODEL = 'tiny-qwen3_5'
TARGETS = ['in_proj_qkv', 'in_proj_b', 'in_proj_a', 'q_proj', 'v_proj', 'down_proj']
GREEDY = dict(temperature=0, max_tokens=6, extra_body={'ignore_eos': True})


@pytest.fixture(scope='module')
def setup(tiny_model_factory, tmp_path_factory):
    path = str(tiny_model_factory('qwen3_5'))
    adapters = {name: write_model_adapter(tmp_path_factory.mktemp(name), path, TARGETS, rank=4, seed=i + 1)
                for i, name in enumerate(['sql', 'chat'])}
    config = PytorchEngineConfig(device_type='cpu', block_size=16, max_batch_size=4, num_gpu_blocks=256,
                                 enable_prefix_caching=True, prefix_cache_state_budget=16, adapters=adapters)
    return path, config


@pytest.fixture(scope='module')
def server(setup):
    engine = AsyncEngine(setup[0], setup[1], model_name=MODEL)
    with live_server(create_app(engine)) as live:
        yield live
    engine.close()


def chat(client: openai.OpenAI, model: str, messages: list[dict]):
    return client.chat.completions.create(model=model, messages=messages, **GREEDY)


def test_models_lists_the_base_model_and_every_adapter(server):
    assert [m.id for m in server.client().models.list().data] == [MODEL, 'sql', 'chat']


def test_turn_two_under_an_adapter_hits_that_adapters_cache_only(server):
    client = server.client()
    history = [{'role': 'user', 'content': 'List the tables of the shop database.'}]
    first = chat(client, 'sql', history)
    assert first.model == 'sql' and first.usage.prompt_tokens_details.cached_tokens == 0
    turn_two = history + [{'role': 'assistant', 'content': first.choices[0].message.content},
                          {'role': 'user', 'content': 'And their columns?'}]
    # the other adapter and the base model have no cache for this conversation: sql's chain is not theirs
    for model in ('chat', MODEL):
        assert chat(client, model, turn_two).usage.prompt_tokens_details.cached_tokens == 0
    second = chat(client, 'sql', turn_two)
    # turn 2 resends turn 1's prompt and reply: everything up to the reply checkpoint comes from sql's cache
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


def test_unknown_model_is_a_404_for_that_request_only(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model='nope', prompt='hi', max_tokens=2)
    assert 'nope' in str(err.value) and 'sql' in str(err.value)
    assert client.completions.create(model='chat', prompt='hi', max_tokens=2).model == 'chat'


def test_pipeline_takes_the_adapter_from_the_generation_config(setup):
    with Pipeline(*setup) as pipe:
        greedy = dict(max_new_tokens=6, ignore_eos=True)
        base, sql, again = pipe(['Say hello.'] * 3, gen_config=[GenerationConfig(**greedy),
                                                                 GenerationConfig(adapter_name='sql', **greedy),
                                                                 GenerationConfig(adapter_name='sql', **greedy)])
        assert sql.token_ids == again.token_ids and sql.token_ids != base.token_ids
        with pytest.raises(UnknownAdapterError, match="unknown adapter 'nope'"):
            pipe('Say hello.', gen_config=GenerationConfig(adapter_name='nope'))
        assert pipe('Say hello.', gen_config=GenerationConfig(**greedy)).token_ids == base.token_ids
