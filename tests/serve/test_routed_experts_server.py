"""Routed experts over the OpenAI server: `return_routed_experts` in the body puts `routed_experts` (base64 of the
little-endian uint16 array, with its shape) on the final choice only; without the engine flag the request is a 400.
A real uvicorn server on loopback over a tiny Qwen3-Next, driven by the `openai` client and raw httpx. A reply cut by
a text stop string still returns the routes of exactly its returned positions (server, `AsyncEngine.stream`, `pipe()`
and `ResponseBuilder` alone); `/metrics` reports the route memory the prefix cache holds."""
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
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from routes_reference import assert_routes_match, build_qwen3_next, reference_routes

from lmdeploy.demo_model import build_tokenizer
from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.request import EngineOutput
from lmdeploy.pytorch.paging.block_trie import route_store
from lmdeploy.serve.async_engine import AsyncEngine
from lmdeploy.serve.openai.api_server import create_app
from lmdeploy.serve.pipeline import Pipeline
from lmdeploy.serve.request_builder import ResponseBuilder
from lmdeploy.serve.tokenizer import Tokenizer

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


def live(path: str, flag: bool, cache: bool = False) -> Iterator[tuple[str, AsyncEngine]]:
    config = PytorchEngineConfig(device_type='cpu', block_size=16, max_batch_size=4, num_gpu_blocks=256,
                                 enable_return_routed_experts=flag, enable_prefix_caching=cache)
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


@pytest.fixture(scope='module')
def cached_server(moe):
    yield from live(moe[0], True, cache=True)


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


# ---- a text stop string ends the reply: the engine is aborted, its abort output brings the routes ----------------
STOP_RUN = 12


def stop_case(async_engine: AsyncEngine) -> tuple[str, int, np.ndarray]:
    """(a stop string that begins inside one token and ends inside the next, the number of reply tokens up to the
    one completing it, the rows of the reply run without it). The cut is found on whole-prefix decodes, not by the
    server's incremental detokenizer."""
    reply, rows = engine_routes(async_engine, STOP_RUN)
    decode_prefix = [async_engine.tokenizer.decode(reply[:j]) for j in range(len(reply) + 1)]
    text = decode_prefix[-1]
    for j in range(2, len(reply) - 2):
        cut = len(decode_prefix[j])
        stop = text[cut - 1:cut + 2]
        if len(stop) == 3 and cut > len(decode_prefix[j - 1]) and text.find(stop) == cut - 1:
            num_kept = next(k for k in range(j + 1, len(reply) + 1) if len(decode_prefix[k]) >= cut + 2)
            assert num_kept < len(reply) - 1  # the engine had more to say: the server's stop cut it
            return stop, num_kept, rows
    raise AssertionError(f'no stop string inside {text!r}')


def assert_cut_routes(routes: np.ndarray, num_kept: int, rows: np.ndarray, moe) -> None:
    """Exactly the rows of the prompt and of the returned reply but its last token: those of the run without the
    stop string, cut there, and transformers' routes of the same tokens."""
    assert routes.shape == (len(PROMPT) + num_kept - 1, 3, 2)
    np.testing.assert_array_equal(routes, rows[:len(PROMPT) + num_kept - 1])
    reply = moe_reply(moe, num_kept)
    assert_routes_match(routes, reference_routes(moe[1], (PROMPT + reply)[:-1]), 2)


def moe_reply(moe, num_tokens: int) -> list[int]:
    """transformers' greedy reply to PROMPT (the reference for the tokens whose routes are compared)."""
    with torch.no_grad():
        out = moe[1].generate(torch.tensor([PROMPT]), max_new_tokens=num_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def wait_idle(async_engine: AsyncEngine) -> None:
    deadline = time.monotonic() + 10
    while async_engine.engine.scheduler.has_unfinished:
        assert time.monotonic() < deadline, 'the engine kept generating after the stop string'
        time.sleep(0.01)
    async_engine.engine.check_integrity()


def test_a_text_stop_string_returns_the_routes_up_to_the_cut(routed_server, moe):
    url, async_engine = routed_server
    stop, num_kept, rows = stop_case(async_engine)
    out = client(url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=STOP_RUN, stop=[stop], **ROUTED)
    assert out.choices[0].finish_reason == 'stop' and out.usage.completion_tokens == num_kept
    assert_cut_routes(decode(out.choices[0].model_extra['routed_experts']), num_kept, rows, moe)
    wait_idle(async_engine)


def test_a_streamed_text_stop_string_puts_the_routes_on_the_last_chunk(routed_server, moe):
    url, async_engine = routed_server
    stop, num_kept, rows = stop_case(async_engine)
    chunks = list(client(url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=STOP_RUN, stop=[stop],
                                                 stream=True, stream_options={'include_usage': True}, **ROUTED))
    choices = [c.choices[0] for c in chunks if c.choices]
    carrying = [i for i, c in enumerate(choices) if (c.model_extra or {}).get('routed_experts')]
    assert carrying == [len(choices) - 1] and choices[-1].finish_reason == 'stop'
    assert stop not in ''.join(c.text for c in choices)
    assert chunks[-1].usage.completion_tokens == num_kept
    assert_cut_routes(decode(choices[-1].model_extra['routed_experts']), num_kept, rows, moe)
    wait_idle(async_engine)


def test_a_text_stop_string_returns_routes_through_stream_and_pipe(routed_server, moe):
    _, async_engine = routed_server
    stop, num_kept, rows = stop_case(async_engine)
    gen = GenerationConfig(max_new_tokens=STOP_RUN, ignore_eos=True, return_routed_experts=True, stop_words=[stop])
    streamed = list(async_engine.stream(async_engine.prepare(PROMPT, gen, do_preprocess=False)))
    assert streamed[-1].finish_reason == 'stop' and streamed[-1].generate_token_len == num_kept
    assert [r.routed_experts is None for r in streamed] == [True] * (len(streamed) - 1) + [False]
    assert_cut_routes(streamed[-1].routed_experts, num_kept, rows, moe)
    wait_idle(async_engine)
    config = PytorchEngineConfig(device_type='cpu', block_size=16, max_batch_size=4, num_gpu_blocks=256,
                                 enable_return_routed_experts=True)
    with Pipeline(moe[0], config) as pipe:
        response = pipe(PROMPT, gen, do_preprocess=False)
        last = list(pipe.stream_infer([PROMPT], gen, do_preprocess=False))[-1]
        wait_idle(pipe.async_engine)
    assert response.finish_reason == 'stop' and response.generate_token_len == num_kept
    assert stop not in response.text
    assert_cut_routes(response.routed_experts, num_kept, rows, moe)
    np.testing.assert_array_equal(last.routed_experts, response.routed_experts)


# ---- /metrics: what the prefix cache keeps for routes --------------------------------------------------------------
def scrape(url: str) -> dict[str, float]:
    text = httpx.get(f'{url}/metrics', timeout=10).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith('lmdeploy:routed_experts')}


def test_metrics_report_the_route_memory_the_prefix_cache_holds(cached_server, routed_server, plain_server):
    url, async_engine = cached_server
    long_prompt = list(range(100, 137))  # 2 full blocks of 16 + 5 tokens
    client(url).completions.create(model=MODEL, prompt=long_prompt, max_tokens=3, temperature=0,
                                   extra_body={'ignore_eos': True})  # did not ask: its routes are cached anyway
    wait_idle(async_engine)
    trie = async_engine.engine.scheduler.trie
    held = route_store.bytes_held(trie.kv.roots.values(), trie.checkpoints.live())  # a walk of the cache
    tails = sum(ck.step % 16 for ck in trie.checkpoints.live() if ck.routes_tail is not None)
    assert held == (2 * 16 + tails) * 12 and tails > 0
    deadline = time.monotonic() + 10
    while scrape(url).get('lmdeploy:routed_experts_cache_bytes') != held:  # published at the end of a step
        assert time.monotonic() < deadline, scrape(url)
        time.sleep(0.02)
    assert scrape(url) == {'lmdeploy:routed_experts_bytes_per_token': 3 * 2 * 2,  # MoE layers x top-k x uint16
                           'lmdeploy:routed_experts_cache_bytes': held}
    # without prefix caching nothing is kept, and without the flag nothing is recorded: no such metric
    assert scrape(routed_server[0]) == {} and scrape(plain_server[0]) == {}


# ---- ResponseBuilder alone: engine outputs fed by hand ----------------------------------------------------------
@pytest.fixture(scope='module')
def text_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp('tok')
    build_tokenizer('qwen3').save_pretrained(str(path))
    return Tokenizer(str(path))


def builder_case(tokenizer, ask: bool):
    text = 'The quick brown fox jumps over the lazy dog.'
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop = 'fox'
    num_kept = next(n for n in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:n]))
    gen = GenerationConfig(stop_words=[stop], return_routed_experts=ask)
    num_prompt = 5
    rows = np.arange((num_prompt + len(ids) - 1) * 2, dtype=np.uint16).reshape(-1, 1, 2)  # row p holds 2p, 2p+1
    return ResponseBuilder(tokenizer, num_prompt, gen), ids, num_kept, rows, num_prompt


def test_stop_string_in_the_engines_last_output_cuts_its_rows(text_tokenizer):
    builder, ids, num_kept, rows, num_prompt = builder_case(text_tokenizer, ask=True)
    assert num_kept < len(ids)
    r = builder.update(EngineOutput(1, ids, finished=True, finish_reason='length', routed_experts=rows))
    assert r.finish_reason == 'stop' and r.generate_token_len == num_kept and not builder.take_abort()
    np.testing.assert_array_equal(r.routed_experts, rows[:num_prompt + num_kept - 1])


def test_a_routed_request_finishes_on_the_engines_abort_output(text_tokenizer):
    builder, ids, num_kept, rows, num_prompt = builder_case(text_tokenizer, ask=True)
    responses = [builder.update(EngineOutput(1, [t])) for t in ids[:num_kept]]
    assert all(r.finish_reason is None and r.routed_experts is None for r in responses)
    assert builder.take_abort() and not builder.take_abort()  # once
    assert builder.update(EngineOutput(1, [ids[num_kept]])) is None  # the engine ran a step past the stop
    final = builder.update(EngineOutput(1, finished=True, finish_reason='abort',
                                        routed_experts=rows[:num_prompt + num_kept]))
    assert (final.text, final.token_ids, final.finish_reason) == ('', [], 'stop')
    assert final.generate_token_len == num_kept and builder.finished and builder.engine_finished
    np.testing.assert_array_equal(final.routed_experts, rows[:num_prompt + num_kept - 1])
    assert ''.join(r.text for r in responses) == text_tokenizer.decode(ids[:num_kept]).split('fox')[0]


def test_a_request_that_did_not_ask_finishes_at_the_stop_string(text_tokenizer):
    builder, ids, num_kept, _, _ = builder_case(text_tokenizer, ask=False)
    responses = [builder.update(EngineOutput(1, [t])) for t in ids[:num_kept]]
    assert responses[-1].finish_reason == 'stop' and builder.take_abort()
    assert builder.update(EngineOutput(1, finished=True, finish_reason='abort')) is None
