"""Flags of `lmdeploy serve api_server` for limits, timeouts, admission, liveness and shutdown (`ServerConfig`).

Names follow LMDeploy (`--max-concurrent-requests`), then vLLM (`--max-logprobs`), uvicorn (`--timeout-keep-alive`,
`--timeout-graceful-shutdown`) and TGI (`--payload-limit`,
`--max-stop-sequences`).
"""
from __future__ import annotations

import argparse
from dataclasses import fields

from ..serve.server_config import ServerConfig

_HELP = {
    'payload_limit': 'largest request body in bytes (413 beyond)',
    'max_messages': 'chat messages per request',
    'max_stop_sequences': 'stop strings per request',
    'max_stop_sequence_length': 'characters of one stop string',
    'max_logprobs': 'largest top_logprobs / logprobs',
    'max_n': 'largest n (choices per request)',
    'max_concurrent_requests': 'requests admitted at once (tokenizing, queued or running); 429 beyond '
                               '(default: 8 x --max-batch-size)',
    'tokenizer_workers': 'threads tokenizing large prompts (small prompts have their own thread)',
    'timeout_header': 'seconds a connection may take to send its request headers (then it is closed)',
    'timeout_body': 'seconds a request may take to send its body (408 beyond)',
    'timeout_keep_alive': 'seconds an idle keep-alive connection is kept open',
    'max_connections': 'open connections (lowered to fit the descriptor limit); the oldest idle one makes room',
    'timeout_graceful_shutdown': 'seconds SIGTERM waits for in-flight requests before aborting them',
    'watchdog_timeout': 'seconds an engine step may run before its requests fail and /health turns 503',
    'enable_metrics_auth': '/metrics needs an API key too (when --api-keys is set)',
}


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group('limits and lifecycle')
    defaults = ServerConfig()
    for f in fields(ServerConfig):
        flag = '--' + f.name.replace('_', '-')
        default = getattr(defaults, f.name)
        if f.type == 'bool':
            group.add_argument(flag, action='store_true', help=_HELP[f.name])
            continue
        kind = float if f.type == 'float' else int
        group.add_argument(flag, type=kind, default=default,
                           help=f'{_HELP[f.name]} (default: {default})' if default is not None else _HELP[f.name])


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(**{f.name: getattr(args, f.name) for f in fields(ServerConfig)})
