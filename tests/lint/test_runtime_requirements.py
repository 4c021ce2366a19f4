"""Every third-party package that `lmdeploy/` imports at module level is declared in `requirements/runtime.txt` (or,
for the CUDA-only modules under a `cuda` package, in `requirements/cuda.txt`), so the README's first command
(`pip install -e .`, no test extras) can import what the demo and the server import (Pillow and httpx were only
pulled in by the test extras until this test)."""
from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module_level_imports(path: Path) -> set[str]:
    """Top-level names of the imports a module runs when it is imported (not those inside functions or a `try`)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names.update(alias.name.split('.')[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split('.')[0])
    return names


def _declared(name: str) -> set[str]:
    lines = (ROOT / 'requirements' / name).read_text().splitlines()
    return {re.split(r'[<>=!~\[; ]', line.strip())[0].lower().replace('_', '-') for line in lines if line.strip()}


def test_module_level_imports_are_runtime_requirements():
    providers = importlib.metadata.packages_distributions()
    runtime, cuda = _declared('runtime.txt'), _declared('cuda.txt')
    missing = {}
    for path in sorted((ROOT / 'lmdeploy').rglob('*.py')):
        declared = runtime | cuda if 'cuda' in path.relative_to(ROOT).parts else runtime
        for name in sorted(_module_level_imports(path) - set(sys.stdlib_module_names) - {'lmdeploy', '__future__'}):
            dists = {d.lower().replace('_', '-') for d in providers.get(name, [name])}
            if not dists & declared:
                missing.setdefault(name, str(path.relative_to(ROOT)))
    assert not missing, f'imported at module level but not in requirements/runtime.txt (name: first file): {missing}'
