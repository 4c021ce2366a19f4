"""OpenAI-compatible HTTP server over one `AsyncEngine`.

Request path: API key check (ASGI middleware, before the body is read; 401) -> body parse and type check (pydantic;
400) -> model name check (404) -> `AsyncEngine.prepare` in a worker thread (tokenize + engine checks; 400) ->
`max_tokens` clamped to what the session leaves -> engine responses streamed out (SSE) or collected.

The event loop never blocks: tokenization runs in a worker thread, the engine on its own thread. Closing the
response iteration (a client disconnect) closes `AsyncEngine.astream`, which aborts the request in the engine:
for SSE Starlette cancels the body iterator, for plain responses `_unless_disconnected` watches the socket.
"""
from __future__ import annotations

import asyncio
import functools
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import replace

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...messages import PytorchEngineConfig
from ...messages import Response as EngineResponse
from ..async_engine import AsyncEngine, PreparedRequest
from ..parsers import REASONING_PARSERS, TOOL_CALL_PARSERS, ChatOutputParser, ParsedDelta
from ..request_builder import TemplateOptions
from ..vision.images import ImageLoadConfig
from .metrics import ServerMetrics
from .protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DeltaToolCall,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    ToolCallOut,
    UsageInfo,
    chat_logprobs,
    completion_logprobs,
    new_id,
    now,
)

OPEN_PATHS = ('/health', '/metrics')


class APIError(Exception):
    """Raised anywhere in a handler; rendered as an OpenAI error body with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = 'invalid_request_error'):
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.info).model_dump(), status_code=self.status)


class ServerState:
    """What the handlers of one app share: the engine, the served name and the metrics."""

    def __init__(self, async_engine: AsyncEngine, model_name: str, reasoning_parser: str | None = None,
                 tool_call_parser: str | None = None):
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f'unknown reasoning parser {reasoning_parser!r}; choose from {sorted(REASONING_PARSERS)}')
        if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f'unknown tool-call parser {tool_call_parser!r}; choose from {sorted(TOOL_CALL_PARSERS)}')
        self.async_engine = async_engine
        self.model_name = model_name
        self.reasoning_parser = reasoning_parser
        self.tool_call_parser = tool_call_parser
        self.created = now()
        self.metrics = ServerMetrics(async_engine.engine)
        tokenizer = async_engine.tokenizer
        self.decode: Callable[[int], str] = functools.lru_cache(maxsize=1 << 16)(
            lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False))

    def check_model(self, model: str | None) -> None:
        if model and model != self.model_name:
            raise APIError(404, f'The model `{model}` does not exist; this server serves `{self.model_name}`.',
                           param='model', code='model_not_found')

    def output_parser(self, body: ChatCompletionRequest, prepared: PreparedRequest) -> ChatOutputParser:
        tools = body.template_tools()
        return ChatOutputParser(self.reasoning_parser, self.tool_call_parser if tools else None, tools,
                                prepared.prompt_text or '')

    async def prepare(self, prompt, body: ChatCompletionRequest | CompletionRequest, do_preprocess: bool,
                      param: str, template: TemplateOptions | None = None) -> PreparedRequest:
        gen = body.to_generation_config()
        try:
            self.async_engine.validate_generation_config(gen)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        try:
            prepared = await asyncio.to_thread(self.async_engine.prepare, prompt, gen, do_preprocess, 0, template)
        except ValueError as exc:
            code = 'context_length_exceeded' if 'session_len' in str(exc) else None
            raise APIError(400, str(exc), param=param, code=code) from exc
        room = self.async_engine.session_len - len(prepared.input_ids)
        wanted = body.requested_max_tokens
        prepared.gen_config.max_new_tokens = room if wanted is None else min(wanted, room)
        return prepared

    async def generate(self, prepared: PreparedRequest, endpoint: str,
                       arrival: float) -> AsyncIterator[EngineResponse]:
        tracker = self.metrics.track(endpoint, arrival)
        try:
            async with aclosing(self.async_engine.astream(prepared)) as stream:
                async for response in stream:
                    tracker.observe(response)
                    yield response
        finally:
            tracker.close()


def _state(request: Request) -> ServerState:
    return request.app.state.server


router = APIRouter(prefix='/v1')


@router.get('/models')
async def list_models(request: Request) -> ModelList:
    state = _state(request)
    return ModelList(data=[ModelCard(id=state.model_name, created=state.created,
                                     max_model_len=state.async_engine.session_len)])


def _chat_delta(parsed: ParsedDelta, num_calls_before: int) -> DeltaMessage:
    calls = [DeltaToolCall(index=num_calls_before + i, id=c.id, function={'name': c.name, 'arguments': c.arguments})
             for i, c in enumerate(parsed.tool_calls)]
    return DeltaMessage(content=parsed.content or None, reasoning_content=parsed.reasoning or None,
                        tool_calls=calls or None)


def _chat_finish_reason(reason: str | None, parser: ChatOutputParser) -> str | None:
    return 'tool_calls' if reason == 'stop' and parser.num_tool_calls else reason


@router.post('/chat/completions')
async def chat_completions(body: ChatCompletionRequest, request: Request):
    arrival, state = time.perf_counter(), _state(request)
    state.check_model(body.model)
    template = TemplateOptions(tools=body.template_tools(), kwargs=body.chat_template_kwargs)
    prepared = await state.prepare(body.prompt(), body, True, 'messages', template)
    parser = state.output_parser(body, prepared)
    responses = state.generate(prepared, 'chat', arrival)
    rid, created, k = new_id('chatcmpl'), now(), body.top_logprobs or 0

    def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=rid, created=created, model=state.model_name, choices=choices, usage=usage)

    def delta(r: EngineResponse) -> ChatCompletionChunk | None:
        logprobs = chat_logprobs(r, k, state.decode) if r.logprobs is not None else None
        num_calls = parser.num_tool_calls
        message = _chat_delta(parser.feed(r.text, final=r.finish_reason is not None), num_calls)
        if not (message.content or message.reasoning_content or message.tool_calls or r.finish_reason
                or (logprobs and logprobs.content)):
            return None
        return chunk([ChatChunkChoice(delta=message, logprobs=logprobs,
                                      finish_reason=_chat_finish_reason(r.finish_reason, parser))])

    if body.stream:
        head = chunk([ChatChunkChoice(delta=DeltaMessage(role='assistant', content=''))])
        usage = (lambda r: chunk([], UsageInfo.of(r))) if body.include_usage else None
        return _event_stream(responses, delta, usage, head)
    final = await _unless_disconnected(request, _collect(responses))
    logprobs = chat_logprobs(final, k, state.decode) if final.logprobs is not None else None
    parsed = parser.feed(final.text, final=True)
    calls = [ToolCallOut(id=c.id, function={'name': c.name, 'arguments': c.arguments}) for c in parsed.tool_calls]
    message = ChatResponseMessage(content=parsed.content if parsed.content or not calls else None,
                                  reasoning_content=parsed.reasoning or None, tool_calls=calls or None)
    choice = ChatChoice(message=message, logprobs=logprobs,
                        finish_reason=_chat_finish_reason(final.finish_reason, parser))
    return ChatCompletionResponse(id=rid, created=created, model=state.model_name, choices=[choice],
                                  usage=UsageInfo.of(final))


@router.post('/completions')
async def completions(body: CompletionRequest, request: Request):
    arrival, state = time.perf_counter(), _state(request)
    state.check_model(body.model)
    prepared = await state.prepare(body.prompt, body, False, 'prompt')
    responses = state.generate(prepared, 'completions', arrival)
    rid, created, k = new_id('cmpl'), now(), body.logprobs
    offset = 0  # characters streamed so far, for logprobs.text_offset

    def completion(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> CompletionResponse:
        return CompletionResponse(id=rid, created=created, model=state.model_name, choices=choices, usage=usage)

    def delta(r: EngineResponse) -> CompletionResponse | None:
        nonlocal offset
        logprobs = completion_logprobs(r, k, state.decode, offset) if r.logprobs is not None else None
        offset += len(r.text)
        if not (r.text or r.finish_reason or (logprobs and logprobs.tokens)):
            return None
        return completion([CompletionChoice(text=r.text, logprobs=logprobs, finish_reason=r.finish_reason)])

    if body.stream:
        usage = (lambda r: completion([], UsageInfo.of(r))) if body.include_usage else None
        return _event_stream(responses, delta, usage)
    final = await _unless_disconnected(request, _collect(responses))
    logprobs = completion_logprobs(final, k, state.decode, 0) if final.logprobs is not None else None
    choice = CompletionChoice(text=final.text, logprobs=logprobs, finish_reason=final.finish_reason)
    return completion([choice], UsageInfo.of(final))


# ---- response plumbing -----------------------------------------------------------------------------------------
def _sse(record: BaseModel) -> str:
    return f'data: {record.model_dump_json()}\n\n'


def _event_stream(responses: AsyncIterator[EngineResponse], delta: Callable[[EngineResponse], BaseModel | None],
                  usage: Callable[[EngineResponse], BaseModel] | None, head: BaseModel | None = None):
    """SSE: `head`, one chunk per non-empty delta, the usage chunk when asked, then `data: [DONE]`.
    An engine failure after the headers went out is reported as an error event before `[DONE]`."""

    async def events() -> AsyncIterator[str]:
        if head is not None:
            yield _sse(head)
        last = None
        async with aclosing(responses):
            async for response in responses:
                last = response
                if response.error:
                    yield _sse(ErrorResponse(error=ErrorInfo(message=response.error, type='internal_error')))
                    break
                chunk = delta(response)
                if chunk is not None:
                    yield _sse(chunk)
        if last is not None and usage is not None:
            yield _sse(usage(last))
        yield 'data: [DONE]\n\n'

    return StreamingResponse(events(), media_type='text/event-stream',
                             headers={'Cache-Control': 'no-cache', 'X-Accel-Buffering': 'no'})


async def _collect(responses: AsyncIterator[EngineResponse]) -> EngineResponse:
    """All deltas of one request merged into one `Response` (text, token ids and logprobs concatenated)."""
    texts, token_ids, logprobs, last = [], [], [], None
    async with aclosing(responses):
        async for last in responses:
            texts.append(last.text)
            token_ids += last.token_ids
            logprobs += last.logprobs or []
    if last.error:
        raise APIError(500, last.error, type='internal_error')
    return replace(last, text=''.join(texts), token_ids=token_ids,
                   logprobs=logprobs if last.logprobs is not None else None)


async def _unless_disconnected(request: Request, work):
    """Await `work`, cancelling it (and so aborting its engine request) if the client disconnects first."""
    async def disconnected() -> None:
        while (await request.receive())['type'] != 'http.disconnect':
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        raise APIError(499, 'the client closed the request', code='client_closed_request') from None


# ---- app -------------------------------------------------------------------------------------------------------
class ApiKeyMiddleware:
    """Rejects requests outside `OPEN_PATHS` without `Authorization: Bearer <one of the keys>` (before any body
    is read)."""

    def __init__(self, app, api_keys: list[str], metrics: ServerMetrics):
        self.app = app
        self.keys = [key.encode() for key in api_keys]
        self.metrics = metrics

    def _authorized(self, scope) -> bool:
        scheme, _, token = Headers(scope=scope).get('authorization', '').partition(' ')
        token = token.strip().encode()
        # compare against every key (no early exit), in constant time per key
        matches = [secrets.compare_digest(token, key) for key in self.keys]
        return scheme.lower() == 'bearer' and any(matches)

    async def __call__(self, scope, receive, send):
        if scope['type'] == 'http' and scope['path'] not in OPEN_PATHS and not self._authorized(scope):
            self.metrics.reject(401)
            error = APIError(401, 'Missing or invalid API key: send "Authorization: Bearer <key>".',
                             code='invalid_api_key')
            response = error.response()
            response.headers['WWW-Authenticate'] = 'Bearer'
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One message and `param` for pydantic's errors. A union field yields one error per member (locations
    `prompt.str`, `prompt.list[int]`, ...); their common location is the param, their messages are joined."""
    if errors[0].get('type') == 'json_invalid':
        return f"invalid JSON body: {errors[0].get('ctx', {}).get('error', errors[0].get('msg'))}", None
    paths = [[str(p) for p in e.get('loc', ())] for e in errors]
    paths = [path[1:] if path[:1] == ['body'] else path for path in paths]
    common = '.'.join(os.path.commonprefix(paths))
    messages = [str(e.get('msg', 'invalid value')).removeprefix('Value error, ') for e in errors]
    if common:
        return f"{common}: {'; '.join(dict.fromkeys(messages[:4]))}", common
    return '; '.join(f"{'.'.join(path) or 'body'}: {msg}" for path, msg in zip(paths[:4], messages)), None


def _install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        metrics.reject(exc.status)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc.errors())
        return await api_error(_, APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = 'not_found' if exc.status_code == 404 else None
        message = str(exc.detail)
        if exc.__cause__ is not None:  # FastAPI's "error parsing the body" hides why (bad UTF-8, nesting too deep)
            message = f'{message}: {exc.__cause__}'
        return await api_error(_, APIError(exc.status_code, message, code=code))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after this response is sent, so the traceback is still logged.
        return await api_error(_, APIError(500, f'internal error: {exc}', type='internal_error'))


def create_app(async_engine: AsyncEngine, api_keys: list[str] | None = None, model_name: str | None = None,
               reasoning_parser: str | None = None, tool_call_parser: str | None = None) -> FastAPI:
    """A FastAPI app serving `async_engine`; the caller owns (and closes) the engine."""
    state = ServerState(async_engine, model_name or async_engine.model_name, reasoning_parser, tool_call_parser)
    app = FastAPI(title='lmdeploy OpenAI-compatible API')
    app.state.server = state
    app.include_router(router)

    @app.get('/health')
    async def health() -> dict:
        return {'status': 'ok'}

    @app.get('/metrics')
    def metrics() -> Response:  # sync: FastAPI runs it in a worker thread, since reading the engine's statistics
        content, media_type = state.metrics.render()  # waits for the running step to end
        return Response(content, media_type=media_type)

    _install_error_handlers(app, state.metrics)
    if api_keys:
        app.add_middleware(ApiKeyMiddleware, api_keys=list(api_keys), metrics=state.metrics)
    return app


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the listening socket now, so a taken port fails before minutes of model loading, not after."""
    family = socket.AF_INET6 if ':' in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f'cannot bind {host}:{port}: {exc.strerror}') from exc
    sock.set_inheritable(True)
    return sock


def serve(model_path: str, engine_config: PytorchEngineConfig | None = None, server_name: str = '127.0.0.1',
          server_port: int = 23333, api_keys: list[str] | None = None, model_name: str | None = None,
          log_level: str = 'info', chat_template: str | None = None, reasoning_parser: str | None = None,
          tool_call_parser: str | None = None, allowed_local_media_path: str | None = None) -> None:
    """Bind the port, load the model and serve it until interrupted. `allowed_local_media_path`: the folder
    `file://` image URLs may read from (None: no local files)."""
    import uvicorn
    sock = bind_socket(server_name, server_port)
    try:
        async_engine = AsyncEngine(model_path, engine_config, model_name, chat_template,
                                   image_load_config=ImageLoadConfig(allowed_local_media_path))
        try:
            app = create_app(async_engine, api_keys, model_name, reasoning_parser, tool_call_parser)
            config = uvicorn.Config(app, log_level=log_level.lower())
            uvicorn.Server(config).run(sockets=[sock])
        finally:
            async_engine.close()
    finally:
        sock.close()
