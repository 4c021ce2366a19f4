"""The published OpenAPI schema matches what the server returns: schemathesis generates requests from
`/openapi.json` (valid and invalid ones) against a live server and checks that no reply is a 5xx and every status,
content type and body is the documented one. Bounded: a 48-token session and a fixed number of examples per
operation keep it to seconds."""
from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from live_server import live_server
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.serve.async_engine import AsyncEngine
from lmdeploy.serve.openai.api_server import create_app

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
EXAMPLES = 25


@pytest.fixture(scope='module')
def live(tiny_model_factory):
    config = PytorchEngineConfig(device_type='cpu', block_size=16, num_gpu_blocks=64, max_batch_size=16,
                                 session_len=48)
    engine = AsyncEngine(tiny_model_factory('qwen3'), config, model_name='tiny')
    with live_server(create_app(engine)) as server:
        yield server
    engine.close()


def _fuzz(operation, failures: list[str]) -> None:
    @given(case=operation.as_strategy())
    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def run(case):
        try:
            case.call_and_validate(checks=CHECKS)
        except BaseException as exc:  # noqa: B036 - schemathesis raises a FailureGroup (an exception group)
            failures.append(f'{operation.label}: {str(exc)[:800]}')

    run()


def test_schema_documents_errors_streams_and_metrics(live):
    schema = httpx.get(f'{live.url}/openapi.json').json()
    chat = schema['paths']['/v1/chat/completions']['post']['responses']
    assert '422' not in chat and {'400', '401', '404', '413', '429', '500'} <= set(chat)
    assert set(chat['200']['content']) == {'application/json', 'text/event-stream'}
    assert chat['400']['content']['application/json']['schema'] == {'$ref': '#/components/schemas/ErrorResponse'}
    assert set(schema['paths']['/metrics']['get']['responses']['200']['content']) == {'text/plain'}
    assert 'ChatCompletionResponse' in schema['components']['schemas']


def test_schemathesis_finds_no_server_errors_or_schema_violations(live):
    schema = schemathesis.openapi.from_url(f'{live.url}/openapi.json')
    failures: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {'POST /v1/chat/completions', 'POST /v1/completions',
                                               'GET /v1/models', 'GET /v1/models/{model_id}', 'GET /metrics'}
    for operation in operations:
        _fuzz(operation, failures)
    assert not failures, '\n\n'.join(failures[:5])


@pytest.mark.parametrize('path,body', [
    ('/v1/completions', {'model': 'tiny', 'prompt': 'hi', 'max_tokens': 3, 'stream': True}),
    ('/v1/chat/completions', {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'hi'}], 'max_tokens': 3,
                              'stream': True}),
], ids=['completions', 'chat'])
def test_every_streamed_event_conforms_to_the_documented_event_schema(live, path, body):
    # the fuzz above sends `stream: true` only now and then; schemathesis validates each SSE event separately
    operation = schemathesis.openapi.from_url(f'{live.url}/openapi.json')[path]['POST']
    case = operation.Case(body=body, media_type='application/json')
    case.call_and_validate(checks=CHECKS)
