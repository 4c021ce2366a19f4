"""The OpenAI-compatible server, end to end: a real uvicorn server on loopback (background thread) over a tiny
random-weight model, driven by the official `openai` client and, for raw HTTP cases, by httpx."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from live_server import MODEL, LiveServer, engine_config

from lmdeploy.serve.async_engine import AsyncEngine
from lmdeploy.serve.openai.api_server import create_app

API_KEY = 'sk-test-key'
GREEDY = dict(temperature=0, extra_body={'ignore_eos': True})
CHAT = [{'role': 'user', 'content': 'Tell me something about the sea.'}]


@pytest.fixture(scope='module')
def server(async_engine, live_server_factory) -> LiveServer:
    return live_server_factory(create_app(async_engine, None, MODEL), async_engine)


@pytest.fixture(scope='module')
def client(server) -> openai.OpenAI:
    return server.client()


def wait_until_idle(async_engine: AsyncEngine, timeout: float = 10.0) -> None:
    """Every KV block back on the free list and both queues empty."""
    scheduler = async_engine.engine.scheduler
    blocks = scheduler.block_manager
    deadline = time.monotonic() + timeout
    while blocks.num_free != blocks.num_blocks or scheduler.running or scheduler.waiting:
        assert time.monotonic() < deadline, (f'engine not idle: {blocks.num_free}/{blocks.num_blocks} blocks free, '
                                             f'{len(scheduler.running)} running, {len(scheduler.waiting)} waiting')
        time.sleep(0.02)


# ---- happy paths -------------------------------------------------------------------------------------------------
def test_models_lists_the_served_model(client, async_engine):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == async_engine.session_len


def test_chat_stream_concatenates_to_non_stream_text(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, **GREEDY)
    choice = full.choices[0]
    assert choice.message.role == 'assistant' and choice.finish_reason == 'length'
    assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    assert full.usage.prompt_tokens_details.cached_tokens == 0

    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, stream=True,
                                                 stream_options={'include_usage': True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == 'assistant'
    text = ''.join(c.choices[0].delta.content or '' for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == 'length'
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_concatenates_to_non_stream_text(client):
    full = client.completions.create(model=MODEL, prompt='Once upon a time', max_tokens=10, **GREEDY)
    assert full.object == 'text_completion' and full.choices[0].finish_reason == 'length'
    assert full.usage.completion_tokens == 10
    chunks = list(client.completions.create(model=MODEL, prompt='Once upon a time', max_tokens=10, stream=True,
                                            **GREEDY))
    assert ''.join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == 'length'


def test_completion_accepts_token_ids_and_reports_usage(client):
    prompt = list(range(100, 120))  # 20 token ids, no chat template, no special tokens added
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, **GREEDY)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (20, 5, 25)
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=MODEL, prompt=[prompt], max_tokens=5, **GREEDY)  # batch of one
    assert again.choices[0].text == out.choices[0].text


def test_chat_logprobs_rank_the_greedy_token_first(client):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, logprobs=True, top_logprobs=3,
                                         **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy picks the top token
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, **GREEDY)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_streamed_and_not(client):
    full = client.completions.create(model=MODEL, prompt='The weather today', max_tokens=6, logprobs=2, **GREEDY)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)
    chunks = list(client.completions.create(model=MODEL, prompt='The weather today', max_tokens=6, logprobs=2,
                                            stream=True, **GREEDY))
    streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs)


def test_stop_string_cuts_the_text(client):
    full = client.completions.create(model=MODEL, prompt='Once upon a time', max_tokens=16, **GREEDY)
    text = full.choices[0].text
    # a printable piece from the middle of the greedy text; the reply must end right before its first occurrence
    start = next(i for i in range(3, len(text) - 2) if text[i:i + 2].isalnum())
    stop = text[start:start + 2]
    out = client.completions.create(model=MODEL, prompt='Once upon a time', max_tokens=16, stop=[stop], **GREEDY)
    assert out.choices[0].text == text[:text.find(stop)]
    assert out.choices[0].finish_reason == 'stop'


def test_seed_makes_sampling_reproducible(client):
    def sample(seed: int) -> str:
        return client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=1.0,
                                              seed=seed, extra_body={'ignore_eos': True}).choices[0].message.content

    assert sample(1234) == sample(1234)
    assert len({sample(1234), sample(1), sample(2)}) > 1


def test_huge_max_tokens_is_clamped_to_the_session(client, async_engine):
    prompt = [100] * (async_engine.session_len - 3)  # room for 3 generated tokens
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10**9, **GREEDY)
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == 'length'


def test_concurrent_clients(server):
    prompts = [f'Question number {i}: why is the sky blue?' for i in range(6)]

    def ask(prompt: str):
        return server.client().chat.completions.create(
            model=MODEL, messages=[{'role': 'user', 'content': prompt}], max_tokens=8, **GREEDY)

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(ask, prompts))
    assert all(r.usage.completion_tokens == 8 and r.choices[0].finish_reason == 'length' for r in results)
    assert len({r.id for r in results}) == len(prompts)
    wait_until_idle(server.async_engine)


# ---- disconnects -------------------------------------------------------------------------------------------------
def _aborted(server: LiveServer, endpoint: str) -> float:
    return server.metrics().get(('lmdeploy:requests_total', (('endpoint', endpoint), ('finish_reason', 'abort'))), 0)


def test_stream_disconnect_aborts_and_frees_blocks(server):
    before = _aborted(server, 'chat')
    body = {'model': MODEL, 'messages': CHAT, 'max_tokens': 100_000, 'stream': True, 'temperature': 0,
            'ignore_eos': True}
    with httpx.stream('POST', f'{server.url}/v1/chat/completions', json=body, timeout=30) as response:
        assert response.status_code == 200
        events = (line for line in response.iter_lines() if line.startswith('data: '))
        next(events)  # the role chunk
        first = json.loads(next(events)[len('data: '):])  # the first generated text: the request is running
        assert first['choices'][0]['finish_reason'] is None
    wait_until_idle(server.async_engine)
    assert _aborted(server, 'chat') == before + 1


def test_non_stream_disconnect_aborts_and_frees_blocks(server):
    before = _aborted(server, 'completions')
    body = {'model': MODEL, 'prompt': 'Once upon a time', 'max_tokens': 100_000, 'ignore_eos': True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f'{server.url}/v1/completions', json=body, timeout=httpx.Timeout(30, read=0.5))
    wait_until_idle(server.async_engine)
    assert _aborted(server, 'completions') == before + 1


# ---- bad requests ------------------------------------------------------------------------------------------------
OVERLONG = 'hello ' * 5000
BAD_REQUESTS = {
    'malformed-json': ('chat/completions', b'{"model": "tiny-qwen3", "messages": [', 400, None),
    'messages-not-a-list': ('chat/completions', {'messages': 'hi'}, 400, 'messages'),
    'temperature-not-a-number': ('chat/completions', {'messages': CHAT, 'temperature': 'hot'}, 400, 'temperature'),
    'empty-messages': ('chat/completions', {'messages': []}, 400, 'messages'),
    'bad-role': ('chat/completions', {'messages': [{'role': 'wizard', 'content': 'x'}]}, 400, 'messages.0.role'),
    'negative-max-tokens': ('chat/completions', {'messages': CHAT, 'max_tokens': -1}, 400, 'max_tokens'),
    'n-0': ('chat/completions', {'messages': CHAT, 'n': 0}, 400, 'n'),
    'n-too-many': ('chat/completions', {'messages': CHAT, 'n': 129}, 400, 'n'),
    'over-long-prompt': ('chat/completions', {'messages': [{'role': 'user', 'content': OVERLONG}]}, 400,
                         'messages'),
    'unknown-model': ('chat/completions', {'model': 'gpt-5', 'messages': CHAT}, 404, 'model'),
    'out-of-vocab-ids': ('completions', {'prompt': [1, 2, 10**6]}, 400, 'prompt'),
    'negative-token-id': ('completions', {'prompt': [1, -5]}, 400, 'prompt'),
    'prompt-wrong-type': ('completions', {'prompt': {'a': 1}}, 400, 'prompt'),
    'empty-stop-string': ('completions', {'prompt': 'a', 'stop': ['']}, 400, None),
    'empty-prompt': ('completions', {'prompt': ''}, 400, 'prompt'),
    'batched-prompts-one-empty': ('completions', {'prompt': ['a', '']}, 400, 'prompt'),
    'logit-bias-not-a-token-id': ('completions', {'prompt': 'a', 'logit_bias': {'x': 1}}, 400, 'logit_bias'),
    'logit-bias-outside-vocab': ('completions', {'prompt': 'a', 'logit_bias': {'99999999': 1}}, 400, None),
    'presence-penalty-3': ('chat/completions', {'messages': CHAT, 'presence_penalty': 3}, 400, 'presence_penalty'),
    'echo': ('completions', {'prompt': 'a', 'echo': True}, 400, None),
    'huge-seed': ('completions', {'prompt': 'a', 'seed': 2**80}, 400, 'seed'),
    # past what the sampling kernels take (float32 / int64): 400 naming the field, not a failed batch
    'huge-top-k': ('completions', {'prompt': 'a', 'top_k': 2**63, 'temperature': 1}, 400, None),
    'huge-repetition-penalty': ('chat/completions', {'messages': CHAT, 'repetition_penalty': 1e39}, 400, None),
}
NAMED_IN_MESSAGE = {'huge-top-k': 'top_k', 'huge-repetition-penalty': 'repetition_penalty'}


@pytest.mark.parametrize('case', list(BAD_REQUESTS))
def test_bad_request_gets_an_openai_error_and_the_server_keeps_serving(server, case):
    path, body, status, param = BAD_REQUESTS[case]
    url = f'{server.url}/v1/{path}'
    if isinstance(body, bytes):
        response = httpx.post(url, content=body, headers={'Content-Type': 'application/json'})
    else:
        response = httpx.post(url, json={'model': MODEL, 'max_tokens': 4, **body})
    assert response.status_code == status, response.text
    error = response.json()['error']
    assert error['type'] == 'invalid_request_error' and error['message']
    if param is not None:
        assert error['param'] == param
    if case == 'unknown-model':
        assert error['code'] == 'model_not_found'
    if case in NAMED_IN_MESSAGE:
        assert NAMED_IN_MESSAGE[case] in error['message']
    if case == 'over-long-prompt':
        assert 'session_len' in error['message'] and error['code'] == 'context_length_exceeded'
    ok = httpx.post(f'{server.url}/v1/completions', json={'model': MODEL, 'prompt': 'hi', 'max_tokens': 2})
    assert ok.status_code == 200


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=CHAT, n=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model='no-such-model', messages=CHAT)
    assert info.value.code == 'model_not_found'


# ---- API keys and metrics ----------------------------------------------------------------------------------------
def test_api_keys_guard_v1_but_not_health(async_engine, live_server_factory):
    guarded = live_server_factory(create_app(async_engine, [API_KEY, 'another-key'], MODEL), async_engine)
    with pytest.raises(openai.AuthenticationError):
        guarded.client('wrong-key').models.list()
    response = httpx.post(f'{guarded.url}/v1/chat/completions', content=b'{not json')  # 401 before the body
    assert response.status_code == 401 and response.json()['error']['code'] == 'invalid_api_key'
    assert httpx.get(f'{guarded.url}/health').status_code == 200
    out = guarded.client(API_KEY).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, **GREEDY)
    assert out.usage.completion_tokens == 2


def test_metrics_reflect_the_traffic(server, client):
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, **GREEDY)
    httpx.post(f'{server.url}/v1/chat/completions', json={'model': MODEL, 'messages': CHAT, 'n': 0})
    m = server.metrics()
    assert m[('lmdeploy:requests_total', (('endpoint', 'chat'), ('finish_reason', 'length')))] >= 1
    assert m[('lmdeploy:rejected_requests_total', (('status', '400'),))] >= 1
    assert m[('lmdeploy:time_to_first_token_seconds_count', ())] >= 1
    assert m[('lmdeploy:generation_tokens_total', ())] >= 3
    assert ('lmdeploy:num_requests_running', ()) in m and ('lmdeploy:num_requests_waiting', ()) in m
    assert 0 <= m[('lmdeploy:kv_cache_usage_ratio', ())] <= 1
    assert m[('lmdeploy:state_cache_usage_ratio', ())] == 0  # dense model: no state pool
    for name in ('lmdeploy:prefix_cache_query_tokens_total', 'lmdeploy:prefix_cache_hit_tokens_total',
                 'lmdeploy:prefix_cache_hit_rate'):
        assert (name, ()) in m


def test_multi_turn_chat_reports_cached_tokens(tiny_model_factory, live_server_factory):
    engine = AsyncEngine(tiny_model_factory('qwen3_5'), engine_config(enable_prefix_caching=True),
                         model_name=MODEL)
    try:
        hybrid = live_server_factory(create_app(engine, None, MODEL), engine)
        client = hybrid.client()
        history = [{'role': 'system', 'content': 'You are a tiny demo model with random weights. ' * 4},
                   {'role': 'user', 'content': 'Hello! Who are you?'}]
        first = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, **GREEDY)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        history += [{'role': 'assistant', 'content': first.choices[0].message.content},
                    {'role': 'user', 'content': 'Tell me something about the sea.'}]
        second = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, **GREEDY)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert 0 < cached < second.usage.prompt_tokens
        m = hybrid.metrics()
        assert m[('lmdeploy:cached_prompt_tokens_total', ())] == cached
    finally:
        engine.close()
    # The same conversation on a cache-off server gives the same replies.
    control = AsyncEngine(tiny_model_factory('qwen3_5'), engine_config(), model_name=MODEL)
    try:
        client = live_server_factory(create_app(control, None, MODEL), control).client()
        cold = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, **GREEDY)
        assert cold.usage.prompt_tokens_details.cached_tokens == 0
        assert cold.choices[0].message.content == second.choices[0].message.content
    finally:
        control.close()
