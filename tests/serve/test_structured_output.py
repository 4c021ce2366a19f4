"""Structured output (xgrammar) through the OpenAI server and the pipeline: every sample of a seeded batch of a
random-weight model follows its JSON schema (checked with `jsonschema`), regex or grammar; grammars compile off
the event loop and once; unconstrained requests in the same batch are untouched."""
from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from live_server import live_server

from lmdeploy import pipeline
from lmdeploy.messages import GenerationConfig, PytorchEngineConfig, StructuredOutput
from lmdeploy.serve.async_engine import AsyncEngine
from lmdeploy.serve.openai.api_server import create_app
from lmdeploy.serve.structured_output import GrammarCompiler

CHAT = [{'role': 'user', 'content': 'Describe a person as JSON.'}]
SCHEMA = {'type': 'object', 'properties': {
    'name': {'type': 'string', 'maxLength': 8},
    'age': {'type': 'integer', 'minimum': 0, 'maximum': 99},
    'color': {'type': 'string', 'enum': ['red', 'green', 'blue']},
    'tags': {'type': 'array', 'items': {'type': 'string', 'enum': ['a', 'b']}, 'maxItems': 2},
    'ok': {'type': 'boolean'}},
    'required': ['name', 'age', 'color', 'tags', 'ok'], 'additionalProperties': False}
REGEX = r'[a-c]{3}-[0-9]{2}'
SAMPLE = dict(temperature=1.0, seed=1234, n=8, max_tokens=120)


def engine_config() -> PytorchEngineConfig:
    return PytorchEngineConfig(device_type='cpu', block_size=16, max_batch_size=16, num_gpu_blocks=512)


@pytest.fixture(scope='module')
def model_path(tiny_model_factory) -> str:
    return tiny_model_factory('qwen3')


@pytest.fixture(scope='module')
def server(model_path):
    engine = AsyncEngine(model_path, engine_config(), model_name='tiny')
    with live_server(create_app(engine)) as live:
        yield live, engine
    engine.close()


def test_every_seeded_sample_validates_against_the_json_schema(server):
    live, _ = server
    fmt = {'type': 'json_schema', 'json_schema': {'name': 'person', 'schema': SCHEMA}}
    r = live.client().chat.completions.create(model='tiny', messages=CHAT, response_format=fmt, **SAMPLE)
    assert len(r.choices) == 8
    for choice in r.choices:
        assert choice.finish_reason == 'stop', choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert len({c.message.content for c in r.choices}) > 1  # sampled, not one forced answer
    again = live.client().chat.completions.create(model='tiny', messages=CHAT, response_format=fmt, **SAMPLE)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]


def test_streamed_json_schema_output_validates(server):
    live, _ = server
    stream = live.client().chat.completions.create(
        model='tiny', messages=CHAT, stream=True, **{**SAMPLE, 'n': 2},
        response_format={'type': 'json_schema', 'json_schema': {'name': 'p', 'schema': SCHEMA}})
    texts = ['', '']
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ''
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_replies_are_json_objects(server):
    live, _ = server
    r = live.client().chat.completions.create(model='tiny', messages=CHAT, response_format={'type': 'json_object'},
                                              **{**SAMPLE, 'max_tokens': 60})
    finished = [c.message.content for c in r.choices if c.finish_reason == 'stop']
    assert finished  # a random model closes some objects within 60 tokens, and nothing else is allowed
    assert all(isinstance(json.loads(text), dict) for text in finished)
    assert all(c.message.content.startswith('{') for c in r.choices)


def test_regex_and_grammar_constraints(server):
    live, _ = server
    client = live.client()
    for extra in ({'guided_regex': REGEX}, {'response_format': {'type': 'regex_schema', 'regex_schema': REGEX}}):
        r = client.completions.create(model='tiny', prompt='Code:', extra_body=extra, **SAMPLE)
        assert all(re.fullmatch(REGEX, c.text) for c in r.choices), [c.text for c in r.choices]
    r = client.completions.create(model='tiny', prompt='Answer:', **SAMPLE,
                                  extra_body={'guided_grammar': 'root ::= "yes" | "no" | "maybe so"'})
    assert {c.text for c in r.choices} <= {'yes', 'no', 'maybe so'} and len(r.choices) == 8


def test_a_grammar_that_ends_before_the_request_does_stays_matched(server):
    """With ignore_eos the request goes on after its grammar accepted a stop token: the rest is stop tokens only, so
    the text still matches; with min_tokens past the grammar's end the tokens up to it are free, then it stops
    (both were a 500 for the whole request)."""
    live, _ = server
    client = live.client()
    r = client.completions.create(model='tiny', prompt='Digit:', extra_body={'guided_regex': '0', 'ignore_eos': True},
                                  **{**SAMPLE, 'max_tokens': 8})
    assert len(r.choices) == 8 and all(c.text == '0' and c.finish_reason == 'length' for c in r.choices), r.choices
    assert r.usage.completion_tokens == 8 * 8, r.usage
    r = client.completions.create(model='tiny', prompt='Digit:', extra_body={'guided_regex': '[ab]', 'min_tokens': 6},
                                  **{**SAMPLE, 'max_tokens': 40})
    assert len(r.choices) == 8 and all(c.text[0] in 'ab' and c.finish_reason == 'stop' for c in r.choices), r.choices
    assert r.usage.completion_tokens == 8 * 6, r.usage  # then the stop token, the only one its row allows (uncounted)


def test_bad_constraints_are_400s(server):
    live, _ = server
    client = live.client()
    with pytest.raises(openai.BadRequestError, match='does not compile'):
        client.completions.create(model='tiny', prompt='x', extra_body={'guided_regex': '[unclosed'})
    with pytest.raises(openai.BadRequestError, match='does not compile'):
        client.completions.create(model='tiny', prompt='x', extra_body={'guided_grammar': 'root ::= missing_rule'})
    with pytest.raises(openai.BadRequestError, match='at most one'):
        client.completions.create(model='tiny', prompt='x', extra_body={'guided_regex': 'a', 'guided_grammar': 'b'})
    with pytest.raises(openai.BadRequestError, match='needs json_schema'):
        client.chat.completions.create(model='tiny', messages=CHAT, response_format={'type': 'json_schema'})


def test_unconstrained_requests_in_the_same_batch_are_untouched(server):
    live, _ = server
    client = live.client()
    plain = dict(model='tiny', prompt='Once upon a time', max_tokens=24, temperature=0,
                 extra_body={'ignore_eos': True})
    alone = client.completions.create(**plain).choices[0].text
    with ThreadPoolExecutor(4) as pool:
        constrained = [pool.submit(client.completions.create, model='tiny', prompt='Code:',
                                   extra_body={'guided_regex': REGEX}, **SAMPLE) for _ in range(2)]
        together = pool.submit(client.completions.create, **plain)
        assert together.result().choices[0].text == alone
        assert all(re.fullmatch(REGEX, c.text) for f in constrained for c in f.result().choices)


def test_grammars_compile_once_and_off_the_event_loop(server, monkeypatch):
    live, engine = server
    calls = []
    original = GrammarCompiler._compile

    def recording(self, spec):
        try:
            asyncio.get_running_loop()
            calls.append('event loop')
        except RuntimeError:
            calls.append('worker')
        return original(self, spec)

    monkeypatch.setattr(GrammarCompiler, '_compile', recording)
    regex = r'z{2}[0-9]'
    for _ in range(3):
        r = live.client().completions.create(model='tiny', prompt='x', extra_body={'guided_regex': regex},
                                             max_tokens=8)
        assert re.fullmatch(regex, r.choices[0].text)
    assert calls == ['worker']


def test_pipeline_structured_output(model_path):
    with pipeline(model_path, engine_config()) as pipe:
        gen = GenerationConfig(max_new_tokens=100, do_sample=True, random_seed=3, n=4,
                               structured_output=StructuredOutput('json_schema', json.dumps(SCHEMA)))
        for response in pipe('A person:', gen):
            jsonschema.validate(json.loads(response.text), SCHEMA)
