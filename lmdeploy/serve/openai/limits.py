"""Per-request limits of a parsed request body (`ServerConfig`); each failure is a 400 naming the field.

Runs after the body is parsed (its size is already bounded by `BodyLimitMiddleware`) and before anything is
tokenized, so a request over a limit costs the server no tokenizer or engine work.
"""
from __future__ import annotations

from ..server_config import ServerConfig
from .errors import APIError


def check_request_limits(body, config: ServerConfig) -> None:
    """`body`: a chat or text completion request record; raises `APIError(400)` for the first limit exceeded."""
    messages = getattr(body, 'messages', None)
    if messages is not None and len(messages) > config.max_messages:
        _refuse('messages', f'{len(messages)} messages; this server accepts at most {config.max_messages} '
                '(--max-messages)')
    stop = getattr(body, 'stop', None)
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    if len(stops) > config.max_stop_sequences:
        _refuse('stop', f'{len(stops)} stop sequences; this server accepts at most {config.max_stop_sequences} '
                '(--max-stop-sequences)')
    for i, word in enumerate(stops):
        if len(word) > config.max_stop_sequence_length:
            _refuse('stop' if isinstance(stop, str) else f'stop.{i}',
                    f'a stop sequence of {len(word)} characters; the limit is {config.max_stop_sequence_length} '
                    '(--max-stop-sequence-length)')
    is_chat = messages is not None
    logprobs = getattr(body, 'top_logprobs' if is_chat else 'logprobs', None)
    if isinstance(logprobs, int) and not isinstance(logprobs, bool) and logprobs > config.max_logprobs:
        _refuse('top_logprobs' if is_chat else 'logprobs',
                f'{logprobs} log-probabilities per token; the limit is {config.max_logprobs} (--max-logprobs)')
    n = getattr(body, 'n', None)
    if isinstance(n, int) and n > config.max_n:
        _refuse('n', f'n={n} choices; the limit is {config.max_n} (--max-n)')


def _refuse(param: str, what: str) -> None:
    raise APIError(400, f'{param}: {what}', param=param, code='limit_exceeded')
