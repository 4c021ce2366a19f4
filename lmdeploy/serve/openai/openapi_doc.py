"""The published OpenAPI schema (`/openapi.json`), made to say what the server really returns.

FastAPI's generated schema documents a 422 validation error the server never sends (it answers 400 with an
OpenAI error body) and knows nothing of the statuses middleware returns before a handler runs, of the streamed
`text/event-stream` replies, or of the Prometheus text of `/metrics`. `document_responses` rewrites it once, at
the first request for it:
- every operation lists the error statuses it can get, each with the `ErrorResponse` body;
- the completion endpoints' 200 has both the JSON record and `text/event-stream`;
- `/metrics` is `text/plain`, `/health` has its 503.
`tests/serve/test_openapi_schema.py` runs schemathesis over the result against a live server.
"""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from .protocol import ErrorResponse

# status -> when (every /v1 operation may get these; /health and /metrics the ones in OPEN_STATUSES)
ERROR_STATUSES = {
    '400': 'Invalid request: malformed JSON, a wrong type or range, an unsupported option, a prompt too long',
    '401': 'Missing or invalid API key (when the server has keys)',
    '404': 'Unknown model (or path)',
    '408': 'The request body took longer than --timeout-body',
    '413': 'The request body is larger than --payload-limit',
    '429': 'Admission control: too many requests in flight (Retry-After)',
    '499': 'The client closed the connection before a non-streamed reply',
    '500': 'The engine failed this request',
    '503': 'The server is draining or the engine is not alive',
}
OPEN_STATUSES = ('401', '404', '503')
STREAMED = ('/v1/chat/completions', '/v1/completions')
_ERROR_REF = {'$ref': '#/components/schemas/ErrorResponse'}


def _error(description: str) -> dict:
    return {'description': description, 'content': {'application/json': {'schema': _ERROR_REF}}}


def _add_error_schemas(schema: dict) -> None:
    components = schema.setdefault('components', {}).setdefault('schemas', {})
    generated = ErrorResponse.model_json_schema(ref_template='#/components/schemas/{model}')
    components.update(generated.pop('$defs', {}))
    components['ErrorResponse'] = generated
    for unused in ('HTTPValidationError', 'ValidationError'):
        components.pop(unused, None)


def _fix_operation(path: str, operation: dict) -> None:
    responses = operation.setdefault('responses', {})
    responses.pop('422', None)
    statuses = ERROR_STATUSES if path.startswith('/v1/') else {k: ERROR_STATUSES[k] for k in OPEN_STATUSES}
    for status, description in statuses.items():
        responses.setdefault(status, _error(description))
    ok = responses.setdefault('200', {'description': 'OK'})
    if path in STREAMED:
        # an SSE media type's schema describes one event (fields data / event / id / retry), as OpenAPI 3.2's
        # itemSchema does and as schemathesis validates each event
        event = {'type': 'object', 'required': ['data'], 'properties': {'data': {'type': 'string'}},
                 'description': 'with "stream": true: server-sent events, each `data: <chunk JSON>`, ending with '
                 '`data: [DONE]`'}
        ok.setdefault('content', {})['text/event-stream'] = {'schema': event}
    if path == '/metrics':
        ok['content'] = {'text/plain': {'schema': {'type': 'string', 'description': 'Prometheus text format'}}}
    if path == '/health':
        health = {'type': 'object', 'properties': {'status': {'type': 'string'}}, 'required': ['status']}
        ok['content'] = {'application/json': {'schema': health}}
        responses['503'] = {'description': 'Draining, or the engine is dead or hung',
                            'content': {'application/json': {'schema': health}}}


def document_responses(app: FastAPI) -> None:
    """Replace `app.openapi` by the corrected schema (built once)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _add_error_schemas(schema)
            for path, item in schema.get('paths', {}).items():
                for operation in item.values():
                    _fix_operation(path, operation)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
