"""Hostile input against a live OpenAI-compatible server (uvicorn on loopback, tiny hybrid Qwen3.5 with prefix
caching on): malformed bodies, wrong types, absurd limits, invalid token ids, over-long prompts, bursts of mixed
valid and invalid requests, disconnects mid-stream and garbage at the HTTP layer.

Contract (design invariant 10): every bad request gets a 4xx with an OpenAI error body; valid requests interleaved
with bad ones give the same greedy output as in isolation; the server stays up; afterwards the engine is idle and
every KV block and state slot is free once the prefix cache is evicted.
"""
from __future__ import annotations

import json
import random
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from live_server import MODEL, LiveServer, engine_config

from lmdeploy.serve.async_engine import AsyncEngine
from lmdeploy.serve.openai.api_server import create_app

CHAT = [{'role': 'user', 'content': 'Tell me something about the sea.'}]
GREEDY = {'temperature': 0, 'ignore_eos': True}
FIGURES: dict[str, int] = {'bad_requests': 0, 'valid_requests': 0, 'disconnects': 0, 'protocol_garbage': 0}


@pytest.fixture(scope='module')
def async_engine(tiny_model_factory) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(tiny_model_factory('qwen3_5'), engine_config(enable_prefix_caching=True,
                                                                     prefix_cache_state_budget=2),
                         model_name=MODEL)
    yield engine
    engine.close()


@pytest.fixture(scope='module')
def server(async_engine, live_server_factory) -> LiveServer:
    return live_server_factory(create_app(async_engine, None, MODEL), async_engine)


def post(server: LiveServer, path: str, body, headers: dict | None = None, timeout: float = 30) -> httpx.Response:
    url = f'{server.url}/v1/{path}'
    if isinstance(body, bytes):
        return httpx.post(url, content=body, headers={'Content-Type': 'application/json', **(headers or {})},
                          timeout=timeout)
    return httpx.post(url, json=body, headers=headers, timeout=timeout)


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None,
                        code: str | None = None) -> dict:
    assert response.status_code == status, response.text[:500]
    body = response.json()
    assert set(body) == {'error'}, body
    error = body['error']
    assert set(error) == {'message', 'type', 'param', 'code'}, error
    assert isinstance(error['message'], str) and error['message'].strip(), error
    assert error['type'] == 'invalid_request_error', error
    if param is not None:
        assert error['param'] == param, error
    if code is not None:
        assert error['code'] == code, error
    return error


def ids_prompt(seed: int, length: int = 24) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(length)]


def valid_body(seed: int) -> dict:
    """A deterministic valid completion: token ids (no tokenizer), greedy, a fixed length."""
    return {'model': MODEL, 'prompt': ids_prompt(seed), 'max_tokens': 6, **GREEDY}


def completion_ids(response: httpx.Response) -> tuple[str, int]:
    assert response.status_code == 200, response.text[:500]
    body = response.json()
    return body['choices'][0]['text'], body['usage']['completion_tokens']


# ---- the catalogue of bad requests: (endpoint, body, status, param, code) -----------------------------------------
def _chat(**fields) -> dict:
    return {'model': MODEL, 'messages': CHAT, 'max_tokens': 4, **fields}


def _completion(**fields) -> dict:
    return {'model': MODEL, 'prompt': 'Once upon a time', 'max_tokens': 4, **fields}


DEEP = b'{"model": "tiny-qwen3", "messages": ' + b'[' * 100_000 + b']' * 100_000 + b'}'
BAD_REQUESTS: dict[str, tuple] = {
    # bodies that are not the JSON object the endpoint expects
    'malformed-json': ('chat/completions', b'{"model": "tiny-qwen3", "messages": [', 400, None, None),
    'not-json': ('chat/completions', b'hello, server', 400, None, None),
    'empty-body': ('chat/completions', b'', 400, None, None),
    'json-array': ('chat/completions', b'[1, 2, 3]', 400, None, None),
    'json-null': ('completions', b'null', 400, None, None),
    'invalid-utf8': ('chat/completions',
                     b'{"model": "tiny-qwen3", "messages": [{"role": "user", "content": "\xff\xfe\xc3\x28"}]}',
                     400, None, None),
    'lone-surrogate': ('chat/completions',
                       b'{"model": "tiny-qwen3", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
                       400, 'messages.0.content', None),
    'deeply-nested': ('chat/completions', DEEP, 400, None, None),
    'nan-temperature': ('chat/completions',
                        b'{"model": "tiny-qwen3", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
                        400, 'temperature', None),
    'infinite-penalty': ('completions',
                         b'{"model": "tiny-qwen3", "prompt": "x", "repetition_penalty": Infinity}',
                         400, 'repetition_penalty', None),
    # wrong types
    'messages-as-string': ('chat/completions', _chat(messages='hi'), 400, 'messages', None),
    'messages-as-object': ('chat/completions', _chat(messages={'role': 'user', 'content': 'x'}), 400, 'messages',
                           None),
    'message-without-role': ('chat/completions', _chat(messages=[{'content': 'x'}]), 400, 'messages.0.role', None),
    'content-as-number': ('chat/completions', _chat(messages=[{'role': 'user', 'content': 5}]), 400,
                          'messages.0.content', None),
    'content-part-not-text': ('chat/completions',
                              _chat(messages=[{'role': 'user', 'content': [{'type': 'image_url', 'image_url': 'x'}]}]),
                              400, 'messages.0.content', None),
    'max-tokens-as-string': ('chat/completions', _chat(max_tokens='10'), 400, 'max_tokens', None),
    'max-tokens-as-bool': ('chat/completions', _chat(max_tokens=True), 400, 'max_tokens', None),
    'max-tokens-fractional': ('completions', _completion(max_tokens=2.5), 400, 'max_tokens', None),
    'temperature-as-list': ('chat/completions', _chat(temperature=[0.5]), 400, 'temperature', None),
    'temperature-as-string': ('completions', _completion(temperature='0.5'), 400, 'temperature', None),
    'stream-as-string': ('chat/completions', _chat(stream='true'), 400, 'stream', None),
    'stop-as-number': ('completions', _completion(stop=7), 400, 'stop', None),
    'model-as-number': ('chat/completions', _chat(model=7), 400, 'model', None),
    'prompt-as-object': ('completions', _completion(prompt={'text': 'x'}), 400, 'prompt', None),
    'float-token-ids': ('completions', _completion(prompt=[1.5, 2.0]), 400, 'prompt', None),
    'bool-token-ids': ('completions', _completion(prompt=[True, False]), 400, 'prompt', None),
    # limits out of range
    'max-tokens-negative': ('chat/completions', _chat(max_tokens=-1), 400, 'max_tokens', None),
    'max-tokens-zero': ('completions', _completion(max_tokens=0), 400, 'max_tokens', None),
    'max-completion-tokens-negative': ('chat/completions', _chat(max_completion_tokens=-5), 400,
                                       'max_completion_tokens', None),
    'top-k-negative': ('chat/completions', _chat(top_k=-5), 400, 'top_k', None),
    'top-p-2': ('chat/completions', _chat(top_p=2), 400, 'top_p', None),
    'top-p-0': ('completions', _completion(top_p=0), 400, 'top_p', None),
    'temperature-negative': ('chat/completions', _chat(temperature=-0.5), 400, 'temperature', None),
    'temperature-huge': ('chat/completions', _chat(temperature=1e308), 400, 'temperature', None),
    'min-tokens-negative': ('completions', _completion(min_tokens=-1), 400, 'min_tokens', None),
    'repetition-penalty-zero': ('completions', _completion(repetition_penalty=0), 400, 'repetition_penalty', None),
    'top-logprobs-21': ('chat/completions', _chat(logprobs=True, top_logprobs=21), 400, 'top_logprobs', None),
    'completion-logprobs-huge': ('completions', _completion(logprobs=10**6), 400, 'logprobs', None),
    'seed-2**80': ('completions', _completion(seed=2**80), 400, 'seed', None),
    'n-0': ('chat/completions', _chat(n=0), 400, 'n', None),
    # token ids the model does not have, prompts it cannot hold
    'token-id-out-of-vocab': ('completions', _completion(prompt=[1, 2, 10**6]), 400, 'prompt', None),
    'token-id-2**70': ('completions', _completion(prompt=[2**70]), 400, 'prompt', None),
    'negative-token-id': ('completions', _completion(prompt=[5, -1, 7]), 400, 'prompt', None),
    'batched-negative-token-ids': ('completions', _completion(prompt=[[-3]]), 400, 'prompt', None),
    'empty-token-list': ('completions', _completion(prompt=[]), 400, 'prompt', None),
    'over-long-token-prompt': ('completions', _completion(prompt=[100] * 5000), 400, 'prompt',
                               'context_length_exceeded'),
    'over-long-chat': ('chat/completions', _chat(messages=[{'role': 'user', 'content': 'hello ' * 5000}]), 400,
                       'messages', 'context_length_exceeded'),
    # everything else
    'unknown-model': ('chat/completions', _chat(model='gpt-5'), 404, 'model', 'model_not_found'),
    'empty-messages': ('chat/completions', _chat(messages=[]), 400, 'messages', None),
    'empty-stop-string': ('completions', _completion(stop=['']), 400, None, None),
}


@pytest.mark.parametrize('case', list(BAD_REQUESTS))
def test_bad_request_gets_a_4xx_openai_error(server, case):
    path, body, status, param, code = BAD_REQUESTS[case]
    assert_openai_error(post(server, path, body), status, param, code)
    FIGURES['bad_requests'] += 1
    assert httpx.get(f'{server.url}/health', timeout=5).status_code == 200


def test_wrong_method_path_and_content_type(server):
    assert_openai_error(httpx.get(f'{server.url}/v1/chat/completions'), 405)
    assert_openai_error(httpx.post(f'{server.url}/v1/no/such/endpoint', json={}), 404, code='not_found')
    # A JSON body labelled as text is not parsed as JSON.
    response = httpx.post(f'{server.url}/v1/completions', content=json.dumps(_completion()).encode(),
                          headers={'Content-Type': 'text/plain'})
    assert_openai_error(response, 400)
    FIGURES['bad_requests'] += 3


@pytest.mark.parametrize('max_tokens', [10**12, 10**30])
def test_absurd_max_tokens_is_clamped_to_the_session(server, max_tokens):
    prompt = [100] * (server.async_engine.session_len - 3)   # room for 3 generated tokens
    response = post(server, 'completions', {'model': MODEL, 'prompt': prompt, 'max_tokens': max_tokens, **GREEDY})
    body = response.json()
    assert response.status_code == 200, body
    assert body['usage']['completion_tokens'] == 3 and body['choices'][0]['finish_reason'] == 'length'
    FIGURES['valid_requests'] += 1


@pytest.fixture(scope='module')
def isolated(server) -> dict[int, tuple[str, int]]:
    """Outputs of the valid requests of the burst, each sent alone (sequentially) first."""
    outputs = {seed: completion_ids(post(server, 'completions', valid_body(seed))) for seed in range(8)}
    FIGURES['valid_requests'] += len(outputs)
    return outputs


def test_burst_of_mixed_valid_and_invalid_requests(server, isolated):
    # 64 requests through 32 concurrent connections: every other one is bad (a rotating pick from the catalogue);
    # some valid ones stream. Valid answers must equal the isolated ones, bad ones must be 4xx OpenAI errors.
    rng = random.Random(1234)
    bad_cases = [c for c in BAD_REQUESTS if c not in ('deeply-nested', 'over-long-chat')]
    jobs = [('valid', i % len(isolated), rng.random() < 0.3) if i % 2 == 0 else ('bad', rng.choice(bad_cases), False)
            for i in range(64)]

    def send(job):
        kind, key, stream = job
        if kind == 'bad':
            path, body, status, param, code = BAD_REQUESTS[key]
            return job, post(server, path, body, timeout=60), None
        if not stream:
            return job, post(server, 'completions', valid_body(key), timeout=60), None
        with httpx.stream('POST', f'{server.url}/v1/completions', json={**valid_body(key), 'stream': True},
                          timeout=60) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith('data: ') and line != 'data: [DONE]']
        return job, response, events

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(send, jobs))
    for (kind, key, stream), response, events in results:
        if kind == 'bad':
            _, _, status, param, code = BAD_REQUESTS[key]
            assert_openai_error(response, status, param, code)
            FIGURES['bad_requests'] += 1
        elif stream:
            assert response.status_code == 200
            text = ''.join(e['choices'][0]['text'] for e in events if e['choices'])
            assert text == isolated[key][0], f'streamed output of valid request {key} changed under load'
            FIGURES['valid_requests'] += 1
        else:
            assert completion_ids(response) == isolated[key], f'output of valid request {key} changed under load'
            FIGURES['valid_requests'] += 1
    assert httpx.get(f'{server.url}/health').status_code == 200


def test_disconnects_mid_stream_abort_and_free(server, isolated):
    # Several streams closed after 1-3 events, concurrently with two plain requests whose clients give up, and with
    # valid requests that must be unaffected.
    def disconnect_stream(k: int):
        body = {'model': MODEL, 'messages': CHAT, 'max_tokens': 100_000, 'stream': True, **GREEDY}
        with httpx.stream('POST', f'{server.url}/v1/chat/completions', json=body, timeout=30) as response:
            assert response.status_code == 200
            events = (line for line in response.iter_lines() if line.startswith('data: '))
            for _ in range(1 + k % 3):
                next(events)
        return 'disconnected'

    def give_up(k: int):
        body = {'model': MODEL, 'prompt': ids_prompt(100 + k), 'max_tokens': 100_000, **GREEDY}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f'{server.url}/v1/completions', json=body, timeout=httpx.Timeout(30, read=0.5))
        return 'gave up'

    def valid(seed: int):
        return completion_ids(post(server, 'completions', valid_body(seed), timeout=60))

    before = {endpoint: aborted(server, endpoint) for endpoint in ('chat', 'completions')}
    with ThreadPoolExecutor(12) as pool:
        drops = [pool.submit(disconnect_stream, k) for k in range(6)] + [pool.submit(give_up, k) for k in range(2)]
        checks = {seed: pool.submit(valid, seed) for seed in range(4)}
        assert [f.result() for f in drops] == ['disconnected'] * 6 + ['gave up'] * 2
        for seed, future in checks.items():
            assert future.result() == isolated[seed]
    FIGURES['disconnects'] += 8
    FIGURES['valid_requests'] += 4
    wait_until_idle(server.async_engine)
    # Every disconnect aborted its engine request (none ran to its 100k-token limit).
    assert aborted(server, 'chat') == before['chat'] + 6
    assert aborted(server, 'completions') == before['completions'] + 2


def aborted(server: LiveServer, endpoint: str) -> float:
    return server.metrics().get(('lmdeploy:requests_total', (('endpoint', endpoint), ('finish_reason', 'abort'))), 0)


def _raw(server: LiveServer, payload: bytes, read: bool = True) -> bytes:
    host, port = server.url.removeprefix('http://').split(':')
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(payload)
        if not read:
            return b''
        try:
            return sock.recv(4096)
        except (TimeoutError, ConnectionResetError):
            return b''


def test_garbage_at_the_http_layer_leaves_the_server_up(server, isolated):
    path = '/v1/chat/completions'
    head = f'POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n'.encode()
    cases = [
        b'GARBAGE\r\n\r\n',
        b'\x00\x01\x02\xff' * 64 + b'\r\n\r\n',
        head + b'Content-Length: 1000\r\n\r\n{"model": "tiny',                         # body cut short, then close
        head + b'Content-Length: -5\r\n\r\n{}',
        head + b'Transfer-Encoding: chunked\r\n\r\nZZZ\r\nnot a chunk\r\n',
        f'POST {path} HTTP/1.1\r\n'.encode() + b'X-Long: ' + b'a' * 100_000 + b'\r\n\r\n',  # oversized header
    ]
    for payload in cases:
        reply = _raw(server, payload, read=b'Content-Length: 1000' not in payload)
        assert not reply or reply.startswith(b'HTTP/1.1 4'), reply[:200]
        FIGURES['protocol_garbage'] += 1
    assert httpx.get(f'{server.url}/health').status_code == 200
    assert completion_ids(post(server, 'completions', valid_body(0))) == isolated[0]
    wait_until_idle(server.async_engine)


def wait_until_idle(async_engine: AsyncEngine, timeout: float = 20.0) -> None:
    """Queues empty and no block held by a request (the prefix cache may still own blocks)."""
    scheduler = async_engine.engine.scheduler
    deadline = time.monotonic() + timeout
    while scheduler.running or scheduler.waiting or async_engine.engine.has_work:
        assert time.monotonic() < deadline, f'engine not idle: {len(scheduler.running)} running, ' \
                                            f'{len(scheduler.waiting)} waiting'
        time.sleep(0.02)


def test_pools_are_free_after_the_abuse(server):
    # Runs last in this module. The engine thread only steps when there is work, so an idle engine can be inspected.
    wait_until_idle(server.async_engine)
    engine = server.async_engine.engine
    scheduler = engine.scheduler
    engine.check_integrity()
    blocks, slots, trie = scheduler.block_manager, scheduler.state_manager, scheduler.trie
    trie_blocks, ck_slots = trie.owners()
    assert blocks.num_free + len(trie_blocks) == blocks.num_blocks, 'a KV block is held outside the cache'
    assert slots.num_free + len(ck_slots) == slots.num_usable, 'a state slot is held outside the cache'
    assert trie.evict_blocks(blocks.num_blocks)
    while trie.evict_slot():
        pass
    assert blocks.num_free == blocks.num_blocks and slots.num_free == slots.num_usable
    engine.check_integrity()
    print(f'\nhostile http: {FIGURES}')
