"""Engine response streams to HTTP: server-sent events, or one collected response per choice.

A request's choices are `AsyncEngine.astream` iterators. Closing any of these (a client disconnect: Starlette
cancels the SSE body iterator; for plain responses `unless_disconnected` watches the socket) closes the engine
streams under it, which aborts their requests in the engine. An engine failure becomes an `APIError` (500, or 503 for
a request aborted by the shutdown): an error event before `[DONE]` once the SSE headers went out, else the response.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import replace

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from ...messages import Response as EngineResponse
from .errors import APIError
from .protocol import ErrorResponse


def sse(record: BaseModel) -> str:
    return f'data: {record.model_dump_json()}\n\n'


def event_stream(streams: list[AsyncIterator[EngineResponse]],
                  delta: Callable[[int, EngineResponse], BaseModel | None],
                  usage: Callable[[list[EngineResponse]], BaseModel] | None, heads: list[BaseModel] | None = None):
    """SSE: the `heads`, one chunk per non-empty delta of any choice (as they come), the usage chunk when asked,
    then `data: [DONE]`. An engine failure after the headers went out is reported as an error event before
    `[DONE]`, and ends every choice."""

    async def events() -> AsyncIterator[str]:
        for head in heads or ():
            yield sse(head)
        lasts: list[EngineResponse | None] = [None] * len(streams)
        async with aclosing(merge_streams(streams)) as merged:
            async for index, response in merged:
                lasts[index] = response
                if response.error:
                    yield sse(ErrorResponse(error=engine_error(response).info))
                    break
                chunk = delta(index, response)
                if chunk is not None:
                    yield sse(chunk)
        if usage is not None and all(last is not None for last in lasts):
            yield sse(usage(lasts))
        yield 'data: [DONE]\n\n'

    return StreamingResponse(events(), media_type='text/event-stream',
                             headers={'Cache-Control': 'no-cache', 'X-Accel-Buffering': 'no'})


def engine_error(response: EngineResponse) -> APIError:
    """An engine-side failure: 503 for a request aborted by the shutdown, 500 otherwise."""
    if response.finish_reason == 'abort':
        return APIError(503, response.error, type='service_unavailable', code='server_shutting_down')
    return APIError(500, response.error, type='internal_error')


async def merge_streams(streams: list[AsyncIterator[EngineResponse]]) -> AsyncIterator[tuple[int, EngineResponse]]:
    """(choice index, response) of all streams as they arrive; closing it closes (and so aborts) every stream."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as stream:
            async for response in stream:
                yield 0, response
        return
    arrivals: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[EngineResponse]) -> None:
        try:
            async with aclosing(stream):
                async for response in stream:
                    arrivals.put_nowait((index, response))
        except Exception as exc:  # re-raised in the consumer
            arrivals.put_nowait((index, exc))
        finally:
            arrivals.put_nowait((index, done))

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await arrivals.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect_all(streams: list[AsyncIterator[EngineResponse]]) -> list[EngineResponse]:
    """Every choice collected; the first failure cancels (and so aborts) the others."""
    if len(streams) == 1:
        return [await collect(streams[0])]
    tasks = [asyncio.ensure_future(collect(stream)) for stream in streams]
    try:
        finished, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task in finished and task.exception() is not None:
                raise task.exception()
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(responses: AsyncIterator[EngineResponse]) -> EngineResponse:
    """All deltas of one request merged into one `Response` (text, token ids and logprobs concatenated)."""
    texts, token_ids, logprobs, last = [], [], [], None
    async with aclosing(responses):
        async for last in responses:
            texts.append(last.text)
            token_ids += last.token_ids
            logprobs += last.logprobs or []
    if last.error:
        raise engine_error(last)
    return replace(last, text=''.join(texts), token_ids=token_ids,
                   logprobs=logprobs if last.logprobs is not None else None)


async def unless_disconnected(request: Request, work):
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
