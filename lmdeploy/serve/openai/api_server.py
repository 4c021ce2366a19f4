"""OpenAI-compatible HTTP server over one `AsyncEngine`.

Request path: API key check (ASGI middleware, before the body is read; 401) -> body read under a size limit and a
deadline, lone surrogates refused (`body.py`; 413, 408, 400) -> body parse and type check (pydantic; 400) -> model
name check (404) -> request limits (`limits.py`; 400) -> `AsyncEngine.prepare` on a `TokenizerPool` lane (tokenize,
length bounded while tokenizing, engine checks; 400) ->
`max_tokens` clamped to what the session leaves -> engine responses streamed out (SSE) or collected.

The event loop never blocks: tokenization runs in a bounded pool of threads, the engine on its own thread. Closing the
response iteration (a client disconnect) closes `AsyncEngine.astream`, which aborts the request in the engine:
for SSE Starlette cancels the body iterator, for plain responses `unless_disconnected` watches the socket
(`response_streams.py`).
"""
from __future__ import annotations

import functools
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...messages import PytorchEngineConfig
from ...messages import Response as EngineResponse
from ..async_engine import AsyncEngine, PreparedRequest, choice_requests
from ..parsers import REASONING_PARSERS, TOOL_CALL_PARSERS, ChatOutputParser, ParsedDelta
from ..request_builder import TemplateOptions
from ..server_config import ServerConfig
from ..vision.images import ImageLoadConfig
from ..watchdog import EngineWatchdog
from .admission import Admission, AdmissionMiddleware
from .body import BodyLimitMiddleware
from .cors import CorsConfig
from .errors import APIError
from .lifecycle import run_app
from .limits import check_request_limits
from .metrics import ServerMetrics
from .openapi_doc import document_responses
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
    ModelCard,
    ModelList,
    RoutedExpertsData,
    ToolCallOut,
    UsageInfo,
    chat_logprobs,
    completion_logprobs,
    new_id,
    now,
)
from .response_streams import collect_all, event_stream, unless_disconnected
from .tokenizer_pool import TokenizerPool, prompt_chars

OPEN_PATHS = ('/health', '/metrics')


class ServerState:
    """What the handlers of one app share: the engine, the served name and the metrics."""

    def __init__(self, async_engine: AsyncEngine, model_name: str, reasoning_parser: str | None = None,
                 tool_call_parser: str | None = None, config: ServerConfig | None = None):
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f'unknown reasoning parser {reasoning_parser!r}; choose from {sorted(REASONING_PARSERS)}')
        if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f'unknown tool-call parser {tool_call_parser!r}; choose from {sorted(TOOL_CALL_PARSERS)}')
        self.async_engine = async_engine
        self.model_name = model_name
        self.reasoning_parser = reasoning_parser
        self.tool_call_parser = tool_call_parser
        self.config = config = config or ServerConfig()
        self.tokenizers = TokenizerPool(config.tokenizer_workers)
        self.watchdog = EngineWatchdog(async_engine, config.watchdog_timeout)
        self.created = now()
        self.metrics = ServerMetrics(async_engine.engine)
        tokenizer = async_engine.tokenizer
        self.decode: Callable[[int], str] = functools.lru_cache(maxsize=1 << 16)(
            lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False))
        self.token_bytes: Callable[[int], bytes] = functools.lru_cache(maxsize=1 << 16)(tokenizer.token_bytes)

    @property
    def served_names(self) -> list[str]:
        """What `model` may name: the base model, then every resident LoRA adapter."""
        return [self.model_name, *self.async_engine.adapter_names]

    def model_card(self, name: str) -> ModelCard:
        return ModelCard(id=name, created=self.created, max_model_len=self.async_engine.session_len)

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter `model` names (None: the base model); 404 for a name this server does not serve."""
        if not model or model == self.model_name:
            return None
        if model in self.async_engine.adapter_names:
            return model
        raise APIError(404, f'The model `{model}` does not exist; this server serves '
                       f'{", ".join(f"`{n}`" for n in self.served_names)}.', param='model', code='model_not_found')

    def output_parser(self, body: ChatCompletionRequest, prepared: PreparedRequest) -> ChatOutputParser:
        tools = body.template_tools()
        return ChatOutputParser(self.reasoning_parser, self.tool_call_parser if tools else None, tools,
                                prepared.prompt_text or '')

    async def prepare(self, prompt, body: ChatCompletionRequest | CompletionRequest, do_preprocess: bool,
                      param: str, template: TemplateOptions | None = None) -> PreparedRequest:
        check_request_limits(body, self.config)
        gen = body.with_defaults(self.async_engine.sampling_defaults).to_generation_config()
        gen.adapter_name = self.check_model(body.model)
        try:
            self.async_engine.validate_generation_config(gen)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        try:
            prepared = await self.tokenizers.run(prompt_chars(prompt), self.async_engine.prepare, prompt, gen,
                                                 do_preprocess, 0, template)
        except ValueError as exc:
            code = 'context_length_exceeded' if 'session_len' in str(exc) else None
            raise APIError(400, str(exc), param=param, code=code) from exc
        room = self.async_engine.session_len - len(prepared.input_ids)
        wanted = body.requested_max_tokens
        prepared.gen_config.max_new_tokens = room if wanted is None else min(wanted, room)
        return prepared

    async def prepare_choices(self, prompts: list, body: ChatCompletionRequest | CompletionRequest,
                              do_preprocess: bool, param: str,
                              template: TemplateOptions | None = None) -> list[PreparedRequest]:
        """Every choice of the request, in order: prompt i's n samples are choices i*n .. i*n+n-1."""
        n, choices = body.num_choices, []
        for i, prompt in enumerate(prompts):
            prepared = await self.prepare(prompt, body, do_preprocess, param, template)
            choices += choice_requests(prepared, i * n)
        return choices

    async def generate(self, prepared: PreparedRequest, endpoint: str,
                       arrival: float) -> AsyncIterator[EngineResponse]:
        tracker = self.metrics.track(endpoint, arrival)
        try:
            def on_first_step(step: float) -> None:
                self.admission.observe_queue_time(arrival, step)
                tracker.first_step(step)

            stream = self.async_engine.astream(prepared, on_first_step=on_first_step)
            async with aclosing(stream) as stream:
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
    return ModelList(data=[state.model_card(name) for name in state.served_names])


@router.get('/models/{model_id:path}')
async def retrieve_model(model_id: str, request: Request) -> ModelCard:
    state = _state(request)
    state.check_model(model_id)  # 404 model_not_found for a name this server does not serve
    return state.model_card(model_id)


def _chat_delta(parsed: ParsedDelta, num_calls_before: int) -> DeltaMessage:
    calls = [DeltaToolCall(index=num_calls_before + i, id=c.id, function={'name': c.name, 'arguments': c.arguments})
             for i, c in enumerate(parsed.tool_calls)]
    return DeltaMessage(content=parsed.content or None, reasoning_content=parsed.reasoning or None,
                        tool_calls=calls or None)


def _chat_finish_reason(reason: str | None, parser: ChatOutputParser) -> str | None:
    return 'tool_calls' if reason == 'stop' and parser.num_tool_calls else reason


@router.post('/chat/completions', response_model=ChatCompletionResponse)
async def chat_completions(body: ChatCompletionRequest, request: Request):
    arrival, state = time.perf_counter(), _state(request)
    state.check_model(body.model)
    template = TemplateOptions(tools=body.template_tools(), kwargs=body.chat_template_kwargs)
    choices = await state.prepare_choices([body.prompt()], body, True, 'messages', template)
    parsers = [state.output_parser(body, c) for c in choices]
    streams = [state.generate(c, 'chat', arrival) for c in choices]
    rid, created, k, n = new_id('chatcmpl'), now(), body.top_logprobs or 0, body.num_choices

    def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=rid, created=created, model=body.model or state.model_name, choices=choices,
                                   usage=usage)

    def delta(index: int, r: EngineResponse) -> ChatCompletionChunk | None:
        parser = parsers[index]
        logprobs = chat_logprobs(r, k, state.decode, state.token_bytes) if r.logprobs is not None else None
        num_calls = parser.num_tool_calls
        message = _chat_delta(parser.feed(r.text, final=r.finish_reason is not None), num_calls)
        if not (message.content or message.reasoning_content or message.tool_calls or r.finish_reason
                or (logprobs and logprobs.content)):
            return None
        return chunk([ChatChunkChoice(index=index, delta=message, logprobs=logprobs,
                                      finish_reason=_chat_finish_reason(r.finish_reason, parser),
                                      routed_experts=RoutedExpertsData.of(r.routed_experts))])

    if body.stream:
        heads = [chunk([ChatChunkChoice(index=c.index, delta=DeltaMessage(role='assistant', content=''))])
                 for c in choices]
        usage = (lambda lasts: chunk([], UsageInfo.total(lasts, n))) if body.include_usage else None
        return event_stream(streams, delta, usage, heads)
    finals = await unless_disconnected(request, collect_all(streams))
    out = []
    for index, (final, parser) in enumerate(zip(finals, parsers)):
        logprobs = chat_logprobs(final, k, state.decode, state.token_bytes) if final.logprobs is not None else None
        parsed = parser.feed(final.text, final=True)
        calls = [ToolCallOut(id=c.id, function={'name': c.name, 'arguments': c.arguments})
                 for c in parsed.tool_calls]
        message = ChatResponseMessage(content=parsed.content if parsed.content or not calls else None,
                                      reasoning_content=parsed.reasoning or None, tool_calls=calls or None)
        out.append(ChatChoice(index=index, message=message, logprobs=logprobs,
                              finish_reason=_chat_finish_reason(final.finish_reason, parser),
                              routed_experts=RoutedExpertsData.of(final.routed_experts)))
    return ChatCompletionResponse(id=rid, created=created, model=body.model or state.model_name, choices=out,
                                  usage=UsageInfo.total(finals, n))


@router.post('/completions', response_model=CompletionResponse)
async def completions(body: CompletionRequest, request: Request):
    arrival, state = time.perf_counter(), _state(request)
    state.check_model(body.model)
    choices = await state.prepare_choices(body.prompts(), body, False, 'prompt')
    streams = [state.generate(c, 'completions', arrival) for c in choices]
    rid, created, k, n = new_id('cmpl'), now(), body.logprobs, body.num_choices
    offsets = [0] * len(choices)  # characters streamed so far per choice, for logprobs.text_offset

    def completion(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> CompletionResponse:
        return CompletionResponse(id=rid, created=created, model=body.model or state.model_name, choices=choices,
                                  usage=usage)

    def delta(index: int, r: EngineResponse) -> CompletionResponse | None:
        logprobs = completion_logprobs(r, k, state.decode, offsets[index]) if r.logprobs is not None else None
        offsets[index] += len(r.text)
        if not (r.text or r.finish_reason or (logprobs and logprobs.tokens)):
            return None
        return completion([CompletionChoice(index=index, text=r.text, logprobs=logprobs,
                                            finish_reason=r.finish_reason,
                                            routed_experts=RoutedExpertsData.of(r.routed_experts))])

    if body.stream:
        usage = (lambda lasts: completion([], UsageInfo.total(lasts, n))) if body.include_usage else None
        return event_stream(streams, delta, usage)
    finals = await unless_disconnected(request, collect_all(streams))
    out = [CompletionChoice(index=index, text=final.text, finish_reason=final.finish_reason,
                            logprobs=completion_logprobs(final, k, state.decode, 0)
                            if final.logprobs is not None else None,
                            routed_experts=RoutedExpertsData.of(final.routed_experts))
           for index, final in enumerate(finals)]
    return completion(out, UsageInfo.total(finals, n))


# ---- app -------------------------------------------------------------------------------------------------------
class ApiKeyMiddleware:
    """Rejects requests outside `OPEN_PATHS` without `Authorization: Bearer <one of the keys>` (before any body
    is read)."""

    def __init__(self, app, api_keys: list[str], metrics: ServerMetrics, open_paths: tuple[str, ...] = OPEN_PATHS):
        self.app = app
        self.open_paths = open_paths
        self.keys = [key.encode() for key in api_keys]
        self.metrics = metrics

    def _authorized(self, scope) -> bool:
        scheme, _, token = Headers(scope=scope).get('authorization', '').partition(' ')
        token = token.strip().encode()
        # compare against every key (no early exit), in constant time per key
        matches = [secrets.compare_digest(token, key) for key in self.keys]
        return scheme.lower() == 'bearer' and any(matches)

    async def __call__(self, scope, receive, send):
        if scope['type'] == 'http' and scope['path'] not in self.open_paths and not self._authorized(scope):
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
               reasoning_parser: str | None = None, tool_call_parser: str | None = None,
               config: ServerConfig | None = None, cors: CorsConfig | None = None) -> FastAPI:
    """A FastAPI app serving `async_engine`; the caller owns (and closes) the engine."""
    state = ServerState(async_engine, model_name or async_engine.model_name, reasoning_parser, tool_call_parser,
                        config)
    config = state.config
    app = FastAPI(title='lmdeploy OpenAI-compatible API')
    app.state.server = state
    app.include_router(router)

    state.admission = admission = Admission(config.admission_limit(async_engine.engine.engine_config.max_batch_size),
                                            lambda: state.watchdog.state, state.metrics.registry)

    @app.get('/health')
    async def health() -> JSONResponse:
        """200 `ok`; 503 `draining`, `engine_dead` or `engine_hung` (a load balancer should go elsewhere)."""
        status = 'draining' if admission.draining else state.watchdog.state.value
        return JSONResponse({'status': status}, status_code=200 if status == 'ok' else 503)

    @app.get('/metrics')
    def metrics() -> Response:  # sync: FastAPI runs it in a worker thread, since reading the engine's statistics
        content, media_type = state.metrics.render()  # waits for the running step to end
        return Response(content, media_type=media_type)

    _install_error_handlers(app, state.metrics)
    # Middleware added last runs first: API key -> admission (neither reads the body) -> body limits -> handlers.
    app.add_middleware(BodyLimitMiddleware, payload_limit=config.payload_limit, timeout_body=config.timeout_body,
                       metrics=state.metrics)
    app.add_middleware(AdmissionMiddleware, admission=admission, metrics=state.metrics)
    if api_keys:
        open_paths = ('/health',) if config.enable_metrics_auth else OPEN_PATHS
        app.add_middleware(ApiKeyMiddleware, api_keys=list(api_keys), metrics=state.metrics, open_paths=open_paths)
    (cors or CorsConfig()).install(app)  # outermost: preflights are answered before the key check
    document_responses(app)
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
          tool_call_parser: str | None = None, config: ServerConfig | None = None,
          generation_config: str = 'auto', allowed_local_media_path: str | None = None,
          cors: CorsConfig | None = None) -> int:
    """Bind the port, load the model and serve it until interrupted; returns the process exit status.
    `allowed_local_media_path`: the folder `file://` image URLs may read from (None: no local files)."""
    sock = bind_socket(server_name, server_port)
    try:
        async_engine = AsyncEngine(model_path, engine_config, model_name, chat_template, generation_config,
                                   image_load_config=ImageLoadConfig(allowed_local_media_path))
        try:
            app = create_app(async_engine, api_keys, model_name, reasoning_parser, tool_call_parser, config, cors)
            return int(run_app(app, sock, log_level))
        finally:
            async_engine.close()
    finally:
        sock.close()
