"""`lmdeploy serve api_server`: the OpenAI-compatible HTTP server (the server itself is imported only when run)."""
from __future__ import annotations

import argparse

from ..serve.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS
from .engine_args import add_engine_args, engine_config_from_args, resolve_model_path
from .server_args import add_server_args, server_config_from_args


def add_parser(sub) -> None:
    parser = sub.add_parser('serve', help='serve a model over HTTP')
    servers = parser.add_subparsers(dest='server', required=True)
    api = servers.add_parser('api_server', help='OpenAI-compatible HTTP server (/v1/chat/completions, ...)')
    api.add_argument('model_path', nargs='?', default=None,
                     help='HF folder or Hub id (default: the built-in demo model)')
    api.add_argument('--server-name', default='127.0.0.1', help='address to bind (0.0.0.0: all interfaces)')
    api.add_argument('--server-port', type=int, default=23333)
    api.add_argument('--model-name', default=None, help='name clients use in `model` (default: the folder name)')
    api.add_argument('--api-keys', nargs='+', default=None,
                     help='accepted Bearer tokens; when given, /v1/* requires one of them')
    api.add_argument('--log-level', default='info', type=str.lower,
                     choices=['critical', 'error', 'warning', 'info', 'debug'], help='case-insensitive (INFO = info)')
    api.add_argument('--chat-template', default=None,
                     help="a Jinja chat template (file or text) replacing the tokenizer's own")
    api.add_argument('--tool-call-parser', default=None, choices=sorted(TOOL_CALL_PARSERS),
                     help='turn the model\'s tool-call blocks into OpenAI tool_calls: qwen3 (JSON in <tool_call>, '
                          'alias hermes/qwen) or qwen3_coder (Qwen3.5 XML, alias qwen3coder/qwen3_5)')
    api.add_argument('--generation-config', default='auto',
                     help="default sampling parameters: 'auto' (the model's generation_config.json), 'none' (the "
                          "OpenAI defaults), or a folder holding a generation_config.json")
    api.add_argument('--reasoning-parser', default=None, choices=sorted(REASONING_PARSERS),
                     help='separate <think>...</think> into reasoning_content')
    api.add_argument('--allowed-local-media-path', default=None,
                     help='folder that file:// image URLs may read from (default: no local files)')
    cors = api.add_argument_group('CORS (browser clients)')
    cors.add_argument('--allow-origins', nargs='+', default=None,
                      help="origins allowed to call the API from a browser ('*': any); CORS is off without it")
    cors.add_argument('--allow-credentials', action='store_true', help='allow cookies / auth headers cross-origin')
    cors.add_argument('--allow-methods', nargs='+', default=['*'], help='allowed methods (default: all)')
    cors.add_argument('--allow-headers', nargs='+', default=['*'], help='allowed request headers (default: all)')
    add_engine_args(api)
    add_server_args(api)
    api.set_defaults(func=run_api_server)


def run_api_server(args: argparse.Namespace) -> int:
    from ..serve.openai.api_server import serve
    return serve(resolve_model_path(args.model_path), engine_config_from_args(args), server_name=args.server_name,
                 server_port=args.server_port, api_keys=args.api_keys, model_name=args.model_name,
                 log_level=args.log_level, chat_template=args.chat_template, reasoning_parser=args.reasoning_parser,
                 tool_call_parser=args.tool_call_parser, config=server_config_from_args(args),
                 generation_config=args.generation_config,
                 allowed_local_media_path=args.allowed_local_media_path, cors=_cors_config(args))


def _cors_config(args: argparse.Namespace):
    from ..serve.openai.cors import CorsConfig
    return CorsConfig(allow_origins=tuple(args.allow_origins or ()), allow_credentials=args.allow_credentials,
                      allow_methods=tuple(args.allow_methods), allow_headers=tuple(args.allow_headers))
