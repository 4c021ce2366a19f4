"""`lmdeploy serve api_server`: the OpenAI-compatible HTTP server (the server itself is imported only when run)."""
from __future__ import annotations

import argparse

from .engine_args import add_engine_args, engine_config_from_args, resolve_model_path
from .server_args import add_server_args, server_config_from_args


def add_parser(sub) -> None:
    parser = sub.add_parser('serve', help='serve a model over HTTP')
    servers = parser.add_subparsers(dest='server', required=True)
    api = servers.add_parser('api_server', help='OpenAI-compatible HTTP server (/v1/chat/completions, ...)')
    api.add_argument('model_path', nargs='?', default=None, help='HF folder (default: the built-in demo model)')
    api.add_argument('--server-name', default='127.0.0.1', help='address to bind (0.0.0.0: all interfaces)')
    api.add_argument('--server-port', type=int, default=23333)
    api.add_argument('--model-name', default=None, help='name clients use in `model` (default: the folder name)')
    api.add_argument('--api-keys', nargs='+', default=None,
                     help='accepted Bearer tokens; when given, /v1/* requires one of them')
    api.add_argument('--log-level', default='info', choices=['critical', 'error', 'warning', 'info', 'debug'])
    add_engine_args(api)
    add_server_args(api)
    api.set_defaults(func=run_api_server)


def run_api_server(args: argparse.Namespace) -> int:
    from ..serve.openai.api_server import serve
    return serve(resolve_model_path(args.model_path), engine_config_from_args(args), server_name=args.server_name,
                 server_port=args.server_port, api_keys=args.api_keys, model_name=args.model_name,
                 log_level=args.log_level, config=server_config_from_args(args))
