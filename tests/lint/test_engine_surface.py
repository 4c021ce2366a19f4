"""The user surfaces (`serve/`, `bench/`, `cli/`) reach the engine only through its public surface: requests,
outputs, configs and the per-step statistics record, never the scheduler, the prefix cache or the pools.

import-linter sees imports, not attribute chains such as `engine.scheduler.trie`; this check walks the syntax tree.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lmdeploy

PACKAGE = Path(lmdeploy.__file__).resolve().parent
SURFACES = ('serve', 'bench', 'cli')
# Attributes of `Engine` that are its internals (everything these layers need is on `Engine.stats_snapshot`).
INTERNALS = {'scheduler', 'trie', 'block_manager', 'state_manager', 'cache_engine', 'agent',
             'inputs_maker', '_step_lock', '_seqs', '_commands'}


def internal_reads(source: str) -> list[tuple[int, str]]:
    return [(node.lineno, node.attr) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr in INTERNALS]


@pytest.mark.parametrize('surface', SURFACES)
def test_surface_reads_no_engine_internals(surface):
    found = [f'{path.relative_to(PACKAGE)}:{line}: .{attr}' for path in sorted((PACKAGE / surface).rglob('*.py'))
             for line, attr in internal_reads(path.read_text())]
    assert not found, 'engine internals read outside the engine:\n' + '\n'.join(found)


def test_check_catches_a_chain_through_the_scheduler():
    source = 'x = engine.scheduler.trie.match(seq)\ny = engine.stats_snapshot.prefix_cache.hit_rate\n'
    assert sorted(internal_reads(source)) == [(1, 'scheduler'), (1, 'trie')]
