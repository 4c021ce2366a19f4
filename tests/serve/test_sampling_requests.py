"""`n`, list prompts, penalties, `min_p`, `logit_bias` and the model's generation_config.json defaults, through the
pipeline and the OpenAI server (official client)."""
from __future__ import annotations

import json
import os
import shutil

import pytest
from chat_templates import QWEN3, QWEN3_PROMPT_ENDS
from live_server import live_server
from scripted_model import save_scripted_model

from lmdeploy import pipeline
from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.serve.async_engine import AsyncEngine
from lmdeploy.serve.openai.api_server import create_app

CHAT = [{'role': 'user', 'content': 'Tell me something about the sea.'}]
SCRIPT = ['Alpha', ' beta', ' gamma']


def engine_config() -> PytorchEngineConfig:
    return PytorchEngineConfig(device_type='cpu', block_size=16, max_batch_size=16, num_gpu_blocks=512,
                               enable_prefix_caching=True)


@pytest.fixture(scope='module')
def random_model(tiny_model_factory) -> str:
    return tiny_model_factory('qwen3')


@pytest.fixture(scope='module')
def server(random_model):
    engine = AsyncEngine(random_model, engine_config(), model_name='tiny')
    with live_server(create_app(engine)) as live:
        yield live
    engine.close()


def test_pipeline_n_gives_n_seeded_reproducible_samples(random_model):
    with pipeline(random_model, engine_config()) as pipe:
        gen = GenerationConfig(max_new_tokens=12, do_sample=True, temperature=1.0, random_seed=5, n=3,
                               ignore_eos=True)
        first, again = pipe(CHAT, gen), pipe(CHAT, gen)
        assert len(first) == 3 and [r.token_ids for r in first] == [r.token_ids for r in again]
        assert len({tuple(r.token_ids) for r in first}) == 3  # seeds 5, 6, 7 sample differently
        # sample j of n is the single request seeded with seed + j
        alone = pipe(CHAT, GenerationConfig(max_new_tokens=12, do_sample=True, random_seed=6, ignore_eos=True))
        assert alone.token_ids == first[1].token_ids
        batch = pipe([CHAT, 'Hello'], gen)
        assert [len(group) for group in batch] == [3, 3] and batch[0][0].token_ids == first[0].token_ids


def test_server_n_choices_streamed_and_not(server):
    client = server.client()
    kwargs = dict(model='tiny', messages=CHAT, max_tokens=8, temperature=1.0, seed=11, n=3,
                  extra_body={'ignore_eos': True})
    r = client.chat.completions.create(**kwargs)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 24 and r.usage.total_tokens == r.usage.prompt_tokens + 24
    chunks = list(client.chat.completions.create(stream=True, stream_options={'include_usage': True}, **kwargs))
    streamed = ['', '', '']
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ''
    assert streamed == [c.message.content for c in r.choices]
    assert chunks[-1].usage.completion_tokens == 24


def test_completions_list_prompts_keep_their_order(server):
    client = server.client()
    prompts = ['Once upon a time', 'The weather today', 'In computer science']
    batch = client.completions.create(model='tiny', prompt=prompts, max_tokens=6, temperature=0, n=2,
                                      extra_body={'ignore_eos': True})
    assert [c.index for c in batch.choices] == list(range(6))
    for i, prompt in enumerate(prompts):
        alone = client.completions.create(model='tiny', prompt=prompt, max_tokens=6, temperature=0,
                                          extra_body={'ignore_eos': True})
        assert batch.choices[2 * i].text == batch.choices[2 * i + 1].text == alone.choices[0].text
    singles = sum(client.completions.create(model='tiny', prompt=p, max_tokens=1).usage.prompt_tokens
                  for p in prompts)
    assert batch.usage.prompt_tokens == singles  # each prompt counted once, not n times


def test_penalties_and_min_p_are_accepted_and_change_sampling(server):
    client = server.client()
    base = dict(model='tiny', prompt='Once upon a time', max_tokens=24, temperature=0,
                extra_body={'ignore_eos': True})
    plain = client.completions.create(**base).choices[0].text
    penalised = client.completions.create(frequency_penalty=2.0, presence_penalty=2.0, **base).choices[0].text
    assert penalised != plain
    min_p = client.completions.create(**{**base, 'temperature': 1.0, 'seed': 3,
                                         'extra_body': {'ignore_eos': True, 'min_p': 1.0}}).choices[0].text
    assert min_p == plain  # min_p = 1 keeps only the most likely token: greedy


def test_logit_bias_steers_the_scripted_model(tmp_path):
    path = save_scripted_model(str(tmp_path / 'abc'), SCRIPT, QWEN3, QWEN3_PROMPT_ENDS)
    engine = AsyncEngine(path, engine_config(), model_name='abc')
    try:
        with live_server(create_app(engine)) as live:
            client = live.client()
            plain = client.chat.completions.create(model='abc', messages=CHAT, temperature=0)
            assert plain.choices[0].message.content == ''.join(SCRIPT)
            gamma = engine.tokenizer.encode(' gamma', add_special_tokens=False)
            assert len(gamma) == 1
            steered = client.chat.completions.create(model='abc', messages=CHAT, temperature=0, max_tokens=1,
                                                     logit_bias={str(gamma[0]): 100})
            assert steered.choices[0].message.content == ' gamma'
    finally:
        engine.close()


def test_generation_config_json_gives_defaults_unless_turned_off(random_model, tmp_path):
    path = str(tmp_path / 'with-defaults')
    shutil.copytree(random_model, path)
    with open(os.path.join(path, 'generation_config.json')) as f:
        config = json.load(f)
    config.update(do_sample=True, temperature=0.7, top_k=1, top_p=0.9)  # top_k=1: sampling is greedy
    with open(os.path.join(path, 'generation_config.json'), 'w') as f:
        json.dump(config, f)
    ask = dict(prompt='Once upon a time', max_tokens=10, n=4, extra_body={'ignore_eos': True})
    for mode in ('auto', 'none'):
        engine = AsyncEngine(path, engine_config(), model_name='d', generation_config=mode)
        try:
            assert engine.sampling_defaults == ({'temperature': 0.7, 'top_k': 1, 'top_p': 0.9} if mode == 'auto'
                                                else {})
            with live_server(create_app(engine)) as live:
                texts = {c.text for c in live.client().completions.create(model='d', **ask).choices}
                greedy = live.client().completions.create(model='d', temperature=0, **ask).choices[0].text
                # auto: the model's top_k=1 makes every sample the greedy reply; none: OpenAI's temperature 1
                assert (texts == {greedy}) is (mode == 'auto')
                # a field the client sets wins over the model's default
                explicit = live.client().completions.create(
                    model='d', seed=1, **{**ask, 'extra_body': {'ignore_eos': True, 'top_k': 0}})
                assert len({c.text for c in explicit.choices}) > 1
        finally:
            engine.close()
