"""Request limits against a live server on loopback: body size (while reading), body deadline, prompt length
(while tokenizing), messages, stop strings, logprobs; surrogates anywhere in the body; tokenization off the event
loop, so a storm of large prompts leaves a tiny request's latency within 2x of its baseline.

Every loop is bounded in count and every wait in time."""
from __future__ import annotations

import json
import socket
import statistics
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest
from live_server import MODEL, LiveServer
from test_hostile_http import assert_openai_error

from lmdeploy.bench.http_load import latency_beside_storm
from lmdeploy.serve.bounded_encode import PIECE_CHARS, PromptTooLong, encode_within
from lmdeploy.serve.openai.api_server import create_app
from lmdeploy.serve.openai.errors import APIError
from lmdeploy.serve.openai.limits import check_request_limits
from lmdeploy.serve.server_config import ServerConfig

CONFIG = ServerConfig(payload_limit=4 << 20, timeout_body=1.0, max_messages=8, max_stop_sequences=4,
                      max_stop_sequence_length=32, max_logprobs=5, max_n=2)
CHAT = [{'role': 'user', 'content': 'Tell me something about the sea.'}]


@pytest.fixture(scope='module')
def server(async_engine, live_server_factory) -> LiveServer:
    return live_server_factory(create_app(async_engine, None, MODEL, config=CONFIG), async_engine)


def _rss_bytes() -> int:
    with open('/proc/self/status') as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith('VmRSS:'))


def _raw_post(server: LiveServer, headers: str, chunks: Iterator[bytes], timeout: float = 5) -> tuple[bytes, int]:
    """Send a request head and body chunks until the server answers or closes; returns (reply, bytes sent)."""
    host, port = server.url.removeprefix('http://').split(':')
    sent = 0
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(f'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n'
                     f'{headers}\r\n'.encode())
        sock.setblocking(False)
        reply = b''
        deadline = time.monotonic() + timeout
        for chunk in chunks:
            try:
                reply += sock.recv(65536)
            except BlockingIOError:
                pass
            except ConnectionError:
                break
            if reply or time.monotonic() > deadline:
                break
            try:
                sock.settimeout(timeout)
                sock.sendall(chunk)
                sock.setblocking(False)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(chunk)
        sock.settimeout(timeout)
        try:
            while True:   # the refusal closes the connection
                data = sock.recv(65536)
                if not data:
                    break
                reply += data
        except (ConnectionError, TimeoutError):
            pass
    return reply, sent


def test_oversized_chunked_body_is_refused_while_read_with_bounded_memory(server):
    piece = b'x' * (1 << 20)
    chunk = b'%x\r\n' % len(piece) + piece + b'\r\n'
    before, start = _rss_bytes(), time.monotonic()
    reply, sent = _raw_post(server, 'Transfer-Encoding: chunked\r\n', (chunk for _ in range(50)))   # 50 MiB
    elapsed = time.monotonic() - start
    assert reply.startswith(b'HTTP/1.1 413'), reply[:200]
    assert elapsed < 1.0, f'refused after {elapsed:.2f} s'
    assert sent < 20 << 20, f'the server read {sent} bytes before refusing'
    assert _rss_bytes() - before < 64 << 20
    print(f'\n50 MiB chunked body: 413 after {elapsed * 1000:.0f} ms, {sent >> 20} MiB sent, '
          f'RSS +{(_rss_bytes() - before) >> 20} MiB')


def test_oversized_content_length_is_refused_before_reading(server):
    start = time.monotonic()
    reply, sent = _raw_post(server, f'Content-Length: {50 << 20}\r\n', iter([b'{"model": ']))
    assert reply.startswith(b'HTTP/1.1 413'), reply[:200]
    assert b'payload_too_large' in reply and time.monotonic() - start < 1.0


def test_body_not_sent_in_time_gets_408(server):
    start = time.monotonic()
    reply, _ = _raw_post(server, 'Content-Length: 100\r\n', iter([b'{"model": ']), timeout=5)
    assert reply.startswith(b'HTTP/1.1 408'), reply[:200]
    assert CONFIG.timeout_body <= time.monotonic() - start < CONFIG.timeout_body + 2


def post(server: LiveServer, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(f'{server.url}/v1/{path}', content=body, headers={'Content-Type': 'application/json'},
                          timeout=30)
    return httpx.post(f'{server.url}/v1/{path}', json=body, timeout=30)


def _chat(**fields) -> dict:
    return {'model': MODEL, 'messages': CHAT, 'max_tokens': 2, **fields}


LIMITED = {
    'stop-count': ('chat/completions', _chat(stop=[f's{i}' for i in range(5)]), 'stop'),
    'stop-100k': ('completions', {'prompt': 'x', 'stop': [f'w{i}' for i in range(100_000)]}, 'stop'),
    'stop-length': ('chat/completions', _chat(stop=['ok', 'y' * 33]), 'stop.1'),
    'stop-length-single': ('completions', {'prompt': 'x', 'stop': 'z' * 40}, 'stop'),
    'messages': ('chat/completions', _chat(messages=CHAT * 9), 'messages'),
    'top-logprobs': ('chat/completions', _chat(logprobs=True, top_logprobs=6), 'top_logprobs'),
    'logprobs': ('completions', {'prompt': 'x', 'logprobs': 6}, 'logprobs'),
}


@pytest.mark.parametrize('case', list(LIMITED))
def test_limits_give_400_naming_the_field(server, case):
    path, body, param = LIMITED[case]
    start = time.monotonic()
    error = assert_openai_error(post(server, path, {'model': MODEL, **body}), 400, param, 'limit_exceeded')
    assert '--' in error['message']  # names the flag that sets the limit
    assert time.monotonic() - start < 5


def test_requests_at_the_limits_are_served(server):
    body = _chat(stop=['s1', 's2', 's3', 'y' * 32], messages=CHAT * 8, logprobs=True, top_logprobs=5)
    response = post(server, 'chat/completions', body)
    assert response.status_code == 200, response.text


def test_n_limit():
    # n > 1 is refused by the schema today; the limit holds whatever the schema accepts.
    with pytest.raises(APIError) as info:
        check_request_limits(SimpleNamespace(n=3, messages=None, stop=None, logprobs=None), CONFIG)
    assert info.value.info.param == 'n'
    check_request_limits(SimpleNamespace(n=2, messages=None, stop=None, logprobs=None), CONFIG)


SURROGATES = {
    'model': b'{"model": "tiny\\udc00", "messages": [{"role": "user", "content": "x"}]}',
    'unknown-field': b'{"model": "tiny-qwen3", "user": "\\ud800", "messages": [{"role": "user", "content": "x"}]}',
    'key': b'{"model": "tiny-qwen3", "\\udfff": 1, "messages": [{"role": "user", "content": "x"}]}',
    'stop': b'{"model": "tiny-qwen3", "stop": ["a", "\\ud83d"], "messages": [{"role": "user", "content": "x"}]}',
    'high-then-high': b'{"model": "tiny-qwen3", "messages": [{"role": "user", "content": "\\ud83d\\ud83d"}]}',
}


@pytest.mark.parametrize('case', list(SURROGATES))
def test_lone_surrogates_anywhere_are_a_400(server, case):
    response = post(server, 'chat/completions', SURROGATES[case])
    error = assert_openai_error(response, 400)
    expected = {'model': 'model', 'unknown-field': 'user', 'stop': 'stop.1',
                'high-then-high': 'messages.0.content'}.get(case)
    if expected:
        assert error['param'] == expected


def test_surrogate_pair_escape_is_text(server):
    body = b'{"model": "tiny-qwen3", "max_tokens": 2, "messages": [{"role": "user", "content": "hi \\ud83d\\ude00"}]}'
    assert post(server, 'chat/completions', body).status_code == 200


# ---- prompt length checked while tokenizing ----------------------------------------------------------------------
def test_far_too_long_prompt_is_refused_after_counting_a_bounded_part(async_engine):
    tokenizer = async_engine.tokenizer
    calls: list[int] = []
    encode = tokenizer.encode

    def counting(text, add_special_tokens=True):
        calls.append(len(text))
        return encode(text, add_special_tokens=add_special_tokens)

    tokenizer.encode = counting
    try:
        with pytest.raises(PromptTooLong, match='session_len'):
            encode_within(tokenizer, 'the quick brown fox ' * 500_000, 1000)   # 10 M characters
    finally:
        del tokenizer.encode
    assert sum(calls) < 20 * PIECE_CHARS, f'{sum(calls)} characters tokenized'


@pytest.mark.parametrize('words', [10, 3_000, 20_000])
def test_bounded_encoding_equals_the_tokenizer(async_engine, words):
    # the reference is the tokenizer itself; texts above PIECE_CHARS are counted in pieces first
    text = ' '.join(f'word{i % 97}  x' if i % 13 == 0 else f'w{i % 31}' for i in range(words))
    tokenizer = async_engine.tokenizer
    expected = tokenizer.encode(text)
    assert encode_within(tokenizer, text, len(expected)) == expected


def test_over_long_chat_names_the_session(server):
    body = _chat(messages=[{'role': 'user', 'content': 'hello ' * 600_000}])    # 3.6 MB of text
    start = time.monotonic()
    assert_openai_error(post(server, 'chat/completions', body), 400, 'messages', 'context_length_exceeded')
    assert time.monotonic() - start < 5


# ---- tokenization off the event loop -----------------------------------------------------------------------------
def test_large_prompts_leave_a_tiny_request_within_2x_of_its_baseline(server):
    # Large prompts: 3.5 MB of text each, just under the body limit, sent back to back from 3 threads.
    big = json.dumps({'model': MODEL, 'max_tokens': 1,
                      'messages': [{'role': 'user', 'content': 'tide and sea ' * 270_000}]}).encode()
    latency = latency_beside_storm(server.url, MODEL, big, num_threads=3, num_samples=7, max_sent=200,
                                   tiny_timeout=30)
    baseline, loaded, sent = statistics.median(latency.baseline), statistics.median(latency.loaded), latency.statuses
    print(f'\ntiny request: baseline {baseline * 1000:.1f} ms, next to large prompts {loaded * 1000:.1f} ms '
          f'({len(sent)} large prompts, statuses {sorted(set(sent))})')
    assert set(sent) == {400}
    assert loaded <= 2 * baseline + 0.01, f'{loaded * 1000:.1f} ms vs baseline {baseline * 1000:.1f} ms'


def test_flags_set_the_limits_and_bad_values_are_refused():
    from lmdeploy.cli.entrypoint import build_parser
    from lmdeploy.cli.server_args import server_config_from_args
    args = build_parser().parse_args(['serve', 'api_server', '--payload-limit', '1000', '--max-stop-sequences', '2',
                                      '--timeout-body', '2.5'])
    config = server_config_from_args(args)
    assert (config.payload_limit, config.max_stop_sequences, config.timeout_body) == (1000, 2, 2.5)
    assert server_config_from_args(build_parser().parse_args(['serve', 'api_server'])) == ServerConfig()
    for bad in ({'payload_limit': 0}, {'max_n': True}, {'timeout_body': float('inf')}, {'max_logprobs': 1.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServerConfig(**bad)
