"""Routed experts over the OpenAI server: `return_routed_experts` in the body puts `routed_experts` (base64 of the
little-endian uint16 array, with its shape) on the final choice only; without the engine flag the request is a 400.
A real uvicorn server on loopback over a tiny Qwen3-Next, driven by the `openai` client and raw httpx."""
from __future__ import annotations

import base64
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
import uvicorn
from routes_reference import assert_routes_match, build_qwen3_next, reference_routes

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.serve.async_engine import AsyncEngine
from lmdeploy.serve.openai.api_server import create_app

MODEL = 'tiny-moe'
PROMPT = list(range(100, 113))
ROUTED = dict(temperature=0, extra_body={'ignore_eos': True, 'return_routed_experts': True})


def decode(field: dict) -> np.ndarray:
    assert field['dtype'] == 'uint16'
    return np.frombuffer(base64.b64decode(field['data']), dtype='<u2').reshape(field['shape'])


@pytest.fixture(scope='module')
def moe(tiny_model_factory):
    return build_qwen3_next(tiny_model_factory)


def serve(async_engine: AsyncEngine) -> tuple[str, uvicorn.Server, threading.Thread]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(('127.0.0.1', 0))
    url = f'http://127.0.0.1:{sock.getsockname()[1]}'
    server = uvicorn.Server(uvicorn.Config(create_app(async_engine, None, MODEL), log_level='warning',
                                           timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={'sockets': [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while True:
        try:
            if httpx.get(f'{url}/health', timeout=1).status_code == 200:
                return url, server, thread
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, 'server did not come up'
        time.sleep(0.05)


def live(path: str, flag: bool) -> Iterator[tuple[str, AsyncEngine]]:
    config = PytorchEngineConfig(device_type='cpu', block_size=16, max_batch_size=4, num_gpu_blocks=256,
                                 enable_return_routed_experts=flag)
    async_engine = AsyncEngine(path, config, model_name=MODEL)
    url, server, thread = serve(async_engine)
    yield url, async_engine
    server.should_exit = True
    thread.join(timeout=10)
    async_engine.close()


@pytest.fixture(scope='module')
def routed_server(moe):
    yield from live(moe[0], True)


@pytest.fixture(scope='module')
def plain_server(moe):
    yield from live(moe[0], False)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f'{url}/v1', api_key='unused', max_retries=0, timeout=30)


def engine_routes(async_engine: AsyncEngine, max_new_tokens: int):
    """The same request through the engine directly: (reply token ids, routed experts)."""
    gen = GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True, return_routed_experts=True)
    final = list(async_engine.stream(async_engine.prepare(PROMPT, gen, do_preprocess=False)))
    return [t for r in final for t in r.token_ids], final[-1].routed_experts


def test_completion_returns_the_routes_of_prompt_and_reply(routed_server, moe):
    url, async_engine = routed_server
    out = client(url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, **ROUTED)
    routes = decode(out.choices[0].model_extra['routed_experts'])
    reply, expected = engine_routes(async_engine, 5)
    assert routes.shape == (len(PROMPT) + 5 - 1, 3, 2)
    np.testing.assert_array_equal(routes, expected)
    assert_routes_match(routes, reference_routes(moe[1], (PROMPT + reply)[:-1]), 2)


def test_chat_returns_routes_in_the_response_and_the_last_chunk_only(routed_server):
    url, _ = routed_server
    messages = [{'role': 'user', 'content': 'Tell me about the sea.'}]
    full = client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=4, **ROUTED)
    routes = decode(full.choices[0].model_extra['routed_experts'])
    assert routes.shape == (full.usage.prompt_tokens + 4 - 1, 3, 2)
    body = {'model': MODEL, 'messages': messages, 'max_tokens': 4, 'temperature': 0, 'ignore_eos': True,
            'return_routed_experts': True, 'stream': True}
    with httpx.stream('POST', f'{url}/v1/chat/completions', json=body, timeout=30) as response:
        events = [line[len('data: '):] for line in response.iter_lines() if line.startswith('data: ')]
    chunks = [json.loads(e) for e in events if e != '[DONE]']
    carrying = [i for i, c in enumerate(chunks) if 'routed_experts' in json.dumps(c)]
    assert carrying == [len(chunks) - 1]
    np.testing.assert_array_equal(decode(chunks[-1]['choices'][0]['routed_experts']), routes)


def test_requests_that_do_not_ask_carry_no_routes_field(routed_server):
    url, _ = routed_server
    body = {'model': MODEL, 'prompt': PROMPT, 'max_tokens': 3, 'temperature': 0, 'ignore_eos': True}
    assert 'routed_experts' not in httpx.post(f'{url}/v1/completions', json=body, timeout=30).text


def test_asking_without_the_engine_flag_is_a_400(plain_server):
    url, _ = plain_server
    with pytest.raises(openai.BadRequestError, match='enable_return_routed_experts'):
        client(url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, **ROUTED)
    out = client(url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert out.usage.completion_tokens >= 1
