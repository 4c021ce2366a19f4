"""Random-field fuzz of /v1/chat/completions and /v1/completions on a live server (loopback, tiny hybrid Qwen3.5
with prefix caching, session 256 tokens so that every accepted request is short): each request starts from a valid
body and sets 1-4 fields (known ones, nested ones, unknown ones) to values drawn from a pool of hostile values:
wrong types, huge and tiny numbers, NaN and Infinity literals, lone surrogates, empty and oversized containers.

Contract: no 5xx, every non-2xx an OpenAI error body, every 200 a well-formed reply (a stream ends with `[DONE]`),
the server healthy afterwards and no block or slot held by a request. CI: 1,500 requests, seeded; the long variant
(`-m slow`): 10,000. `LMDEPLOY_FUZZ_REQUESTS=N` overrides the count.
"""
from __future__ import annotations

import collections
import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from live_server import MODEL, LiveServer, engine_config
from test_hostile_http import wait_until_idle

from lmdeploy.serve.async_engine import AsyncEngine
from lmdeploy.serve.openai.api_server import create_app

NAN, INF = object(), object()   # stand-ins serialised as the raw JSON literals NaN / Infinity
SURROGATE = '\ud800'
SCALARS: list[Any] = [None, True, False, 0, 1, -1, 2, 3, 17, 2**31, 2**63, 2**64, -2**63 - 1, 10**30, 0.5, -0.5,
                      1.0, 2.0000001, 1e-320, 1e308, -1e308, NAN, INF, '', 'x', '1', 'true', SURROGATE,
                      'a' + SURROGATE, 'ok \U0001F600', 'auto', 'none', 'required', 'stop', 'function', 'user',
                      'text', 'z' * 3000]


def _value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth > 2 or roll < 0.6:
        return rng.choice(SCALARS)
    if roll < 0.8:
        return [_value(rng, depth + 1) for _ in range(rng.choice([0, 1, 2, 5, 40]))]
    keys = rng.sample(['type', 'text', 'role', 'content', 'name', 'function', 'arguments', 'include_usage',
                       'parameters', 'x', SURROGATE], rng.randint(0, 3))
    return {k: _value(rng, depth + 1) for k in keys}


CHAT_FIELDS = ['model', 'messages', 'max_tokens', 'max_completion_tokens', 'temperature', 'top_p', 'top_k', 'min_p',
               'n', 'stop', 'stream', 'stream_options', 'seed', 'logprobs', 'top_logprobs', 'presence_penalty',
               'frequency_penalty', 'repetition_penalty', 'logit_bias', 'min_tokens', 'ignore_eos', 'tools',
               'tool_choice', 'parallel_tool_calls', 'chat_template_kwargs', 'response_format', 'user',
               'return_routed_experts', 'unknown_field']
COMPLETION_FIELDS = ['model', 'prompt', 'max_tokens', 'temperature', 'top_p', 'top_k', 'min_p', 'n', 'stop',
                     'stream', 'stream_options', 'seed', 'logprobs', 'presence_penalty', 'frequency_penalty',
                     'repetition_penalty', 'logit_bias', 'min_tokens', 'ignore_eos', 'echo', 'best_of', 'suffix',
                     'user', 'unknown_field']
# Plausible values, so that many fuzzed requests are valid and reach the engine (streams, n > 1, logprobs, stops).
PLAUSIBLE: dict[str, list] = {
    'max_tokens': [1, 2, 5, 300], 'max_completion_tokens': [1, 4], 'temperature': [0, 0.7, 1.5], 'top_p': [0.5, 1],
    'top_k': [0, 1, 5], 'min_p': [0, 0.2], 'n': [1, 2, 3], 'stop': ['.', ['a', 'the'], 'e'], 'stream': [True],
    'stream_options': [{'include_usage': True}], 'seed': [0, 42], 'logprobs': [True, 2], 'top_logprobs': [0, 3],
    'presence_penalty': [0.5, -1], 'frequency_penalty': [1.0], 'repetition_penalty': [1.2, 0.8],
    'logit_bias': [{'5': 2.0}, {}], 'min_tokens': [1, 2], 'ignore_eos': [True], 'echo': [False],
    'prompt': [[9] * 250, 'a b c d', [[5, 6]], ['one prompt']], 'user': ['someone'],
    'tools': [[{'type': 'function', 'function': {'name': 'f', 'parameters': {'type': 'object'}}}]],
    'tool_choice': ['auto', 'none'], 'chat_template_kwargs': [{'enable_thinking': False}],
    'messages': [[{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi'}],
                 [{'role': 'user', 'content': [{'type': 'text', 'text': 'Hello'}]}]],
}
MESSAGE_FIELDS = ['role', 'content', 'name', 'tool_calls', 'tool_call_id', 'reasoning_content']


def _body(rng: random.Random) -> tuple[str, dict]:
    if rng.random() < 0.5:
        path, fields = 'chat/completions', CHAT_FIELDS
        body = {'model': MODEL, 'messages': [{'role': 'user', 'content': 'Tell me about the sea.'}], 'max_tokens': 3}
    else:
        path, fields = 'completions', COMPLETION_FIELDS
        body = {'model': MODEL, 'prompt': rng.choice(['Once upon a time', [5, 6, 7, 8]]), 'max_tokens': 3}
    for _ in range(rng.randint(1, 5)):
        if path == 'chat/completions' and rng.random() < 0.25:   # a field of a message
            message = dict(body['messages'][0]) if isinstance(body.get('messages'), list) and body['messages'] \
                and isinstance(body['messages'][0], dict) else {'role': 'user'}
            message[rng.choice(MESSAGE_FIELDS)] = _value(rng)
            body['messages'] = [message]
        else:
            field = rng.choice(fields)
            plausible = PLAUSIBLE.get(field)
            body[field] = rng.choice(plausible) if plausible and rng.random() < 0.6 else _value(rng)
    return path, body


def _encode(value: Any) -> str:
    # json.dumps escapes lone surrogates as \ud800 (ensure_ascii); NaN / Infinity become their raw literals.
    text = json.dumps(value, default=lambda v: f'@@{"NaN" if v is NAN else "Infinity"}@@')
    return text.replace('"@@NaN@@"', 'NaN').replace('"@@Infinity@@"', 'Infinity')


def _check(response: httpx.Response, streamed: bool, body_text: str) -> str:
    status = response.status_code
    assert status < 500, f'{status} for {body_text[:600]}: {response.text[:600]}'
    if status != 200:
        error = response.json()['error']
        assert set(error) == {'message', 'type', 'param', 'code'} and error['message'], error
        return f'{status}'
    if streamed:
        lines = [line for line in response.text.splitlines() if line.startswith('data: ')]
        assert lines and lines[-1] == 'data: [DONE]', response.text[-300:]
        for line in lines[:-1]:
            event = json.loads(line[6:])
            assert 'choices' in event or 'error' in event, event
        return '200 stream'
    reply = response.json()
    assert reply['choices'] and 'usage' in reply, reply
    return '200'


@pytest.fixture(scope='module')
def async_engine(tiny_model_factory):
    engine = AsyncEngine(tiny_model_factory('qwen3_5'),
                         engine_config(enable_prefix_caching=True, prefix_cache_state_budget=2, session_len=256),
                         model_name=MODEL)
    yield engine
    engine.close()


@pytest.fixture(scope='module')
def server(async_engine, live_server_factory) -> LiveServer:
    return live_server_factory(create_app(async_engine, None, MODEL), async_engine)


def run_fuzz(server: LiveServer, num_requests: int, seed: int) -> collections.Counter:
    rng = random.Random(seed)
    jobs = [_body(rng) for _ in range(num_requests)]

    def send(job: tuple[str, dict]) -> str:
        path, body = job
        text = _encode(body)
        streamed = body.get('stream') is True
        with httpx.Client() as client:
            response = client.post(f'{server.url}/v1/{path}', content=text.encode(), timeout=60,
                                   headers={'Content-Type': 'application/json'})
        return _check(response, streamed, text)

    start = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        outcomes = collections.Counter(pool.map(send, jobs))
    elapsed = time.monotonic() - start
    assert httpx.get(f'{server.url}/health', timeout=10).status_code == 200
    wait_until_idle(server.async_engine)
    server.async_engine.engine.check_integrity()
    blocks, trie = server.async_engine.engine.scheduler.block_manager, server.async_engine.engine.scheduler.trie
    assert blocks.num_free + len(trie.owners()[0]) == blocks.num_blocks, 'a KV block is held outside the cache'
    print(f'\nhttp fuzz (seed {seed}): {num_requests} requests in {elapsed:.1f} s, outcomes '
          f'{dict(sorted(outcomes.items()))}, 5xx: 0')
    return outcomes


def test_fuzz_both_endpoints_gives_no_5xx(server):
    n = int(os.environ.get('LMDEPLOY_FUZZ_REQUESTS', 1500))
    outcomes = run_fuzz(server, n, seed=20261201)
    assert sum(v for k, v in outcomes.items() if k.startswith('200')) > n // 20, 'the fuzz must reach the engine'


@pytest.mark.slow
def test_fuzz_both_endpoints_long(server):
    run_fuzz(server, int(os.environ.get('LMDEPLOY_FUZZ_REQUESTS', 10_000)), seed=7)
