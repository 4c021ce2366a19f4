"""`BodyLimitMiddleware`: reads a request body under a size limit and a deadline, before any handler sees it.

- `Content-Length` above `payload_limit`: 413 at once, nothing read.
- A body (chunked or not) that grows past the limit while being read: 413 as soon as it does; at most
  `payload_limit` bytes (plus one network read) are ever held.
- A body not complete within `timeout_body` seconds of the headers: 408.
- JSON that holds a lone UTF-16 surrogate escape (`"\\ud800"`) in any string, key or value, any field: 400 naming
  the field. Such strings are valid JSON but not Unicode text; nothing downstream (tokenizer, logs, error bodies)
  can encode them. Only bodies with a surrogate escape pay the extra parse.

The handler then receives the buffered body as one message; later `receive()` calls (disconnect detection) go to
the client as before.
"""
from __future__ import annotations

import asyncio
import json
import re

from starlette.datastructures import Headers

from .errors import APIError
from .metrics import ServerMetrics

_SURROGATE_ESCAPE = re.compile(rb'\\u[dD][89abcdefABCDEF]')
_BODY_METHODS = ('POST', 'PUT', 'PATCH')


class BodyLimitMiddleware:

    def __init__(self, app, payload_limit: int, timeout_body: float, metrics: ServerMetrics):
        self.app = app
        self.payload_limit = payload_limit
        self.timeout_body = timeout_body
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope['type'] != 'http' or scope['method'] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read(scope, receive)
            if body is None:  # the client went away while sending
                return
            check_no_lone_surrogates(body)
        except APIError as error:
            self.metrics.reject(error.status)
            response = error.response()
            response.headers['Connection'] = 'close'  # the rest of an over-long body is not read
            await response(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, scope, receive) -> bytes | None:
        length = Headers(scope=scope).get('content-length')
        if length is not None and length.isdigit() and int(length) > self.payload_limit:
            raise _too_large(self.payload_limit, f'Content-Length is {int(length)} bytes')
        chunks, size = [], 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_body
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except asyncio.TimeoutError:
                raise APIError(408, f'the request body was not received within {self.timeout_body:g} s '
                               '(--timeout-body)', code='request_timeout') from None
            if message['type'] == 'http.disconnect':
                return None
            chunk = message.get('body', b'')
            size += len(chunk)
            if size > self.payload_limit:
                raise _too_large(self.payload_limit, 'the body is larger')
            chunks.append(chunk)
            if not message.get('more_body', False):
                return b''.join(chunks)


def _too_large(limit: int, what: str) -> APIError:
    return APIError(413, f'request body too large: {what}; this server accepts at most {limit} bytes '
                    '(--payload-limit)', code='payload_too_large')


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {'type': 'http.request', 'body': body, 'more_body': False}
        return await receive()

    return replay


def check_no_lone_surrogates(body: bytes) -> None:
    """Raise `APIError(400)` naming the first string of a JSON body that holds a lone surrogate."""
    if not _SURROGATE_ESCAPE.search(body):
        return
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return  # not JSON: the handler's parser says why
    path = _lone_surrogate_path(parsed)
    if path is not None:
        param = '.'.join(path)
        raise APIError(400, f'{param or "body"}: the text is not valid Unicode (a lone surrogate)',
                       param=param or None)


def _lone_surrogate_path(value, path: tuple[str, ...] = ()) -> tuple[str, ...] | None:
    # iterative over the container nesting that `json.loads` accepted (it bounds the depth by recursion itself)
    stack = [(value, path)]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not _encodable(value):
                return path
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                if not _encodable(key):
                    return path + (key.encode('utf-8', 'replace').decode(),)
                stack.append((item, path + (key,)))
        elif isinstance(value, list):
            stack.extend((item, path + (str(i),)) for i, item in reversed(list(enumerate(value))))
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode('utf-8')
    except UnicodeEncodeError:
        return False
    return True
