"""Every test the docs cite exists: `tests/<folder>/test_x.py` is a file, `tests/...py::name` names a function or
class defined in it, and a bare `test_name` in backticks is defined in some test module. Test files are cited by
their path from the repository root (a bare `test_x.py` does not say which folder it moved to).
"""
from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / 'docs').glob('*.md')) + [ROOT / 'README.md']

PATH_CITE = re.compile(r'(?<![\w/.])(tests/[\w/]+\.py)(?:::(\w+))?')
BARE_FILE = re.compile(r'(?<![\w/.])(test_\w+\.py)\b')
BARE_NAME = re.compile(r'`(test_\w+)`')


@cache
def defined_names(path: Path) -> set[str]:
    """Functions and classes at any depth (test methods of a class included)."""
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}


def broken_citations(doc: str, doc_name: str, root: Path) -> list[str]:
    """One line per citation in `doc` that names no existing test file or definition."""
    broken: list[str] = []
    every_name = set().union(*(defined_names(p) for p in (root / 'tests').rglob('test_*.py')))
    for number, line in enumerate(doc.splitlines(), 1):
        where = f'{doc_name}:{number}'
        for rel, name in PATH_CITE.findall(line):
            path = root / rel
            if not path.is_file():
                broken.append(f'{where}: {rel} does not exist')
            elif name and name not in defined_names(path):
                broken.append(f'{where}: {rel} defines no {name}')
        for match in BARE_FILE.finditer(line):
            broken.append(f'{where}: {match.group(1)} cited without its tests/<folder>/ path')
        for name in BARE_NAME.findall(line):
            if name not in every_name:
                broken.append(f'{where}: no test module defines {name}')
    return broken


def test_every_test_cited_in_the_docs_exists():
    broken = [line for doc in DOCS for line in broken_citations(doc.read_text(), doc.name, ROOT)]
    assert not broken, 'docs cite tests that do not exist:\n' + '\n'.join(broken)


def test_check_flags_a_moved_file_a_missing_name_and_a_bare_file(tmp_path):
    (tmp_path / 'tests' / 'engine').mkdir(parents=True)
    (tmp_path / 'tests' / 'engine' / 'test_a.py').write_text('def test_here():\n    pass\n')
    doc = ('`tests/engine/test_a.py::test_here` and `tests/engine/test_a.py`\n'
           '`tests/test_a.py` `tests/engine/test_a.py::test_gone`\n'
           'see test_a.py, `test_here`, `test_nowhere`\n')
    assert broken_citations(doc, 'x.md', tmp_path) == [
        'x.md:2: tests/test_a.py does not exist',
        'x.md:2: tests/engine/test_a.py defines no test_gone',
        'x.md:3: test_a.py cited without its tests/<folder>/ path',
        'x.md:3: no test module defines test_nowhere',
    ]
