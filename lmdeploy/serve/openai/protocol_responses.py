"""OpenAI wire format, the response half: usage, logprobs, tool calls, the chat / completion responses and stream
chunks, model cards and the error body. Re-exported by `protocol` (import from there); the request records live
there too.
"""
from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field

from ...messages import Response


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, response: Response) -> UsageInfo:
        return cls.total([response], 1)

    @classmethod
    def total(cls, responses: list[Response], n: int) -> UsageInfo:
        """Usage of a request's choices (ordered prompt by prompt, `n` each): each prompt counts once."""
        firsts = responses[::n]
        prompt = sum(r.input_token_len for r in firsts)
        completion = sum(r.generate_token_len for r in responses)
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(r.cached_tokens for r in firsts)))


class RoutedExpertsData(BaseModel):
    """`Response.routed_experts` compactly: `data` is the base64 of the array's bytes, little-endian uint16 in
    row-major order, of `shape` [num_prompt + num_generated - 1, num_moe_layers, top_k]. Decode with
    `np.frombuffer(base64.b64decode(data), '<u2').reshape(shape)`."""
    dtype: Literal['uint16'] = 'uint16'
    shape: list[int]
    data: str

    @classmethod
    def of(cls, routes: np.ndarray | None) -> RoutedExpertsData | None:
        if routes is None:
            return None
        little = np.ascontiguousarray(routes, dtype='<u2')
        return cls(shape=list(little.shape), data=base64.b64encode(little.tobytes()).decode('ascii'))


def _absent(value) -> bool:
    return value is None


# Only present where asked for and only in the final chunk / response (no bytes in other chunks).
RoutedExpertsField = Field(None, exclude_if=_absent)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobToken]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal['function'] = 'function'
    function: FunctionCallOut


class DeltaToolCall(ToolCallOut):
    """A streamed tool call: sent whole, in one delta, once its block is complete."""
    index: int


class ChatResponseMessage(BaseModel):
    role: Literal['assistant'] = 'assistant'
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    routed_experts: RoutedExpertsData | None = RoutedExpertsField


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal['chat.completion'] = 'chat.completion'
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal['assistant'] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    routed_experts: RoutedExpertsData | None = RoutedExpertsField


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal['chat.completion.chunk'] = 'chat.completion.chunk'
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    routed_experts: RoutedExpertsData | None = RoutedExpertsField


class CompletionResponse(BaseModel):
    """Also the streamed chunk (OpenAI uses the same `text_completion` object for both)."""
    id: str
    object: Literal['text_completion'] = 'text_completion'
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal['model'] = 'model'
    created: int
    owned_by: str = 'lmdeploy'
    max_model_len: int


class ModelList(BaseModel):
    object: Literal['list'] = 'list'
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str = 'invalid_request_error'
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- logprobs: engine dicts {token_id: logprob} -> wire format ---------------------------------------------------
def _ranked(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    # The engine may return more than k alternatives (the batch's largest k) plus the sampled token.
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def chat_logprobs(response: Response, k: int, decode: Callable[[int], str],
                  token_bytes: Callable[[int], bytes] | None = None) -> ChatLogprobs:
    """`token_bytes`: the token's own bytes (part of a UTF-8 character for some tokens); default: its text's."""
    def item(token_id: int, logprob: float) -> TopLogprob:
        token = decode(token_id)
        raw = token_bytes(token_id) if token_bytes is not None else token.encode()
        return TopLogprob(token=token, logprob=logprob, bytes=list(raw))

    content = []
    for token_id, entry in zip(response.token_ids, response.logprobs or ()):
        chosen = item(token_id, entry.get(token_id, float('-inf')))
        content.append(ChatLogprobToken(**chosen.model_dump(),
                                        top_logprobs=[item(t, lp) for t, lp in _ranked(entry, k)]))
    return ChatLogprobs(content=content)


def completion_logprobs(response: Response, k: int, decode: Callable[[int], str],
                        offset: int) -> CompletionLogprobs:
    """`offset`: characters of completion text before this delta (for `text_offset`)."""
    out = CompletionLogprobs()
    for token_id, entry in zip(response.token_ids, response.logprobs or ()):
        token = decode(token_id)
        out.tokens.append(token)
        out.token_logprobs.append(entry.get(token_id, float('-inf')))
        out.top_logprobs.append({decode(t): lp for t, lp in _ranked(entry, k)})
        out.text_offset.append(offset)
        offset += len(token)
    return out
