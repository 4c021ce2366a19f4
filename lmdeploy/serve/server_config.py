"""`ServerConfig`: the API server's limits, timeouts and lifecycle knobs (one CLI flag each, `cli/serve.py`).

Every limit bounds what one client can make the server do before it is refused: bytes read, tokens counted,
messages rendered, stop strings encoded, requests admitted, connections held, time waited. Defaults follow the
field (TGI: 2 MB bodies, 4 stop sequences; vLLM: 20 logprobs; uvicorn: 5 s keep-alive) with room for long-context
chats; each is a flag.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class ServerConfig:
    # Request limits (413, or 400 naming the field).
    payload_limit: int = 8 << 20            # bytes of one request body, checked while it is read
    max_messages: int = 2048                # chat messages per request
    max_stop_sequences: int = 16            # stop strings per request
    max_stop_sequence_length: int = 1024    # characters of one stop string
    max_logprobs: int = 20                  # chat `top_logprobs`, completions `logprobs`
    max_n: int = 16                         # choices per request (`n`)
    # Admission: requests admitted (tokenizing, queued or running); beyond it 429. None: 8 x max_batch_size.
    max_concurrent_requests: int | None = None
    # Tokenization: worker threads for large prompts (small ones have their own lane, so they never wait behind).
    tokenizer_workers: int = 2
    # Connections (seconds; counts).
    timeout_header: float = 10.0            # from connect (or the end of the last response) to complete headers
    timeout_body: float = 30.0              # from the headers to the end of the body
    timeout_keep_alive: float = 5.0         # idle keep-alive connection
    max_connections: int = 4096             # open connections; lowered to fit RLIMIT_NOFILE at start
    # Liveness: a step running longer than this fails its requests and turns /health to 503.
    watchdog_timeout: float = 300.0
    # Shutdown: SIGTERM drains in-flight requests for this long, then aborts the rest.
    timeout_graceful_shutdown: float = 30.0
    # /metrics needs an API key (when keys are set).
    enable_metrics_auth: bool = False

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == 'enable_metrics_auth':
                ok = isinstance(value, bool)
            elif f.name == 'max_concurrent_requests':
                ok = value is None or (_is_int(value) and value > 0)
            elif f.type == 'int':
                ok = _is_int(value) and value > 0
            else:
                ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) \
                    and value > 0
            if not ok:
                raise ValueError(f'{f.name} must be a positive {f.type}, got {value!r}')

    def admission_limit(self, max_batch_size: int) -> int:
        return self.max_concurrent_requests or 8 * max_batch_size


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
