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
    # Tokenization: worker threads for large prompts (small ones have their own lane, so they never wait behind).
    tokenizer_workers: int = 2
    # Connections (seconds).
    timeout_body: float = 30.0              # from the headers to the end of the body

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == 'int':
                ok = _is_int(value) and value > 0
            else:
                ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) \
                    and value > 0
            if not ok:
                raise ValueError(f'{f.name} must be a positive {f.type}, got {value!r}')


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
