"""Server surface: CORS, /v1/models/{id}, the port bound before the model loads, LMDeploy's flag names and metric
names (with TPOT, inter-token, prefill, decode and queue-time histograms)."""
from __future__ import annotations

import socket
import time

import httpx
import openai
import pytest
from live_server import live_server
from prometheus_client.parser import text_string_to_metric_families

from lmdeploy.cli.entrypoint import build_parser
from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.serve.async_engine import AsyncEngine
from lmdeploy.serve.openai.api_server import create_app, serve
from lmdeploy.serve.openai.cors import CorsConfig
from lmdeploy.version import __version__

ORIGIN = 'https://chat.example.org'


@pytest.fixture(scope='module')
def engine(tiny_model_factory):
    engine = AsyncEngine(tiny_model_factory('qwen3'), PytorchEngineConfig(device_type='cpu', block_size=16,
                                                                            num_gpu_blocks=256), model_name='tiny')
    yield engine
    engine.close()


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(f'{url}/metrics').text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if not s.labels or s.name.endswith(('_count', '_sum'))}


def test_cors_preflight_is_answered_before_the_api_key_check(engine):
    app = create_app(engine, api_keys=['sk-1'], cors=CorsConfig(allow_origins=(ORIGIN,), allow_credentials=True))
    with live_server(app) as live:
        preflight = httpx.options(f'{live.url}/v1/chat/completions', headers={
            'Origin': ORIGIN, 'Access-Control-Request-Method': 'POST',
            'Access-Control-Request-Headers': 'authorization, content-type'})
        assert preflight.status_code == 200
        assert preflight.headers['access-control-allow-origin'] == ORIGIN
        assert preflight.headers['access-control-allow-credentials'] == 'true'
        listed = httpx.get(f'{live.url}/v1/models', headers={'Origin': ORIGIN, 'Authorization': 'Bearer sk-1'})
        assert listed.status_code == 200 and listed.headers['access-control-allow-origin'] == ORIGIN
        other = httpx.get(f'{live.url}/v1/models', headers={'Origin': 'https://evil.example', 'Authorization':
                                                             'Bearer sk-1'})
        assert 'access-control-allow-origin' not in other.headers


def test_without_allow_origins_there_are_no_cors_headers(engine):
    with live_server(create_app(engine)) as live:
        response = httpx.get(f'{live.url}/v1/models', headers={'Origin': ORIGIN})
        assert response.status_code == 200 and 'access-control-allow-origin' not in response.headers
    with pytest.raises(ValueError, match='allow-credentials'):
        CorsConfig(allow_origins=('*',), allow_credentials=True)


def test_retrieve_model_by_id(engine):
    with live_server(create_app(engine)) as live:
        card = live.client().models.retrieve('tiny')
        assert (card.id, card.object) == ('tiny', 'model')
        with pytest.raises(openai.NotFoundError) as info:
            live.client().models.retrieve('org/other-model')
        assert info.value.code == 'model_not_found'


def test_a_taken_port_fails_before_the_model_loads(tmp_path):
    taken = socket.socket()
    taken.bind(('127.0.0.1', 0))
    taken.listen()
    port = taken.getsockname()[1]
    start = time.perf_counter()
    try:  # a folder that is no model: loading it first would raise ValueError, not OSError
        with pytest.raises(OSError, match=f'cannot bind 127.0.0.1:{port}'):
            serve(str(tmp_path / 'no-model-here'), server_port=port)
    finally:
        taken.close()
    assert time.perf_counter() - start < 2


def test_lmdeploy_flag_names_are_accepted(capsys):
    parser = build_parser()
    args = parser.parse_args(['serve', 'api_server', 'model', '--backend', 'pytorch', '--log-level', 'INFO',
                              '--chat-template', 'tpl.jinja', '--tool-call-parser', 'qwen3_coder',
                              '--reasoning-parser', 'qwen3', '--allow-origins', '*', '--allow-methods', 'GET',
                              'POST', '--generation-config', 'none'])
    assert (args.backend, args.log_level, args.chat_template) == ('pytorch', 'info', 'tpl.jinja')
    assert (args.tool_call_parser, args.reasoning_parser, args.allow_origins) == ('qwen3_coder', 'qwen3', ['*'])
    assert args.allow_methods == ['GET', 'POST'] and args.generation_config == 'none'
    assert parser.parse_args(['chat', '--backend', 'pytorch']).backend == 'pytorch'
    for flag in ('-v', '--version'):
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args([flag])
        assert info.value.code == 0 and capsys.readouterr().out.strip() == f'lmdeploy {__version__}'
    with pytest.raises(SystemExit):
        build_parser().parse_args(['serve', 'api_server', '--backend', 'turbomind'])


def test_metrics_use_lmdeploy_names_with_timing_histograms(engine):
    with live_server(create_app(engine)) as live:
        before = _metrics(live.url)
        stream = live.client().chat.completions.create(
            model='tiny', messages=[{'role': 'user', 'content': 'Hi'}], max_tokens=6, temperature=0, stream=True,
            extra_body={'ignore_eos': True})
        assert sum(1 for c in stream if c.choices and c.choices[0].delta.content) >= 1
        after = _metrics(live.url)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew('lmdeploy:generation_tokens_total') == 6
    for name in ('lmdeploy:time_to_first_token_seconds_count', 'lmdeploy:time_per_output_token_seconds_count',
                 'lmdeploy:request_prefill_time_seconds_count', 'lmdeploy:request_decode_time_seconds_count',
                 'lmdeploy:request_inference_time_seconds_count', 'lmdeploy:request_queue_time_seconds_count',
                 'lmdeploy:e2e_request_latency_seconds_count'):
        assert grew(name) == 1, name
    assert grew('lmdeploy:iter_token_latency_count') == 5  # one gap per token after the first
    assert 'lmdeploy:num_requests_running' in after and 'lmdeploy:num_requests_waiting' in after
    assert 0 < grew('lmdeploy:request_decode_time_seconds_sum') < grew('lmdeploy:e2e_request_latency_seconds_sum')
