"""docs/serving.md names every flag of `lmdeploy serve api_server` and `lmdeploy chat` (so it stays complete)."""
from __future__ import annotations

import os

from lmdeploy.cli.entrypoint import build_parser

DOC = os.path.join(os.path.dirname(__file__), '..', '..', 'docs', 'serving.md')


def test_every_serve_and_chat_flag_is_documented():
    commands = build_parser()._subparsers._group_actions[0].choices
    api_server = commands['serve']._subparsers._group_actions[0].choices['api_server']
    with open(DOC) as f:
        doc = f.read().replace('--[no-]', '--')
    flags = {o for parser in (api_server, commands['chat']) for action in parser._actions
             for o in action.option_strings if o.startswith('--') and o != '--help'}
    assert len(flags) > 40
    assert sorted(f for f in flags if f.replace('--no-', '--') not in doc) == []
