"""A script of `benchmark/` loaded as a module for a test, and unloaded afterwards.

Scripts put their own folder on `sys.path` to import the helpers beside them (`bench_harness`, ...); a test must
not leave those modules or that path behind, or a later test would see another script's copy of them.
"""
from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parents[1] / 'benchmark'


@contextlib.contextmanager
def bench_script(name: str) -> Iterator[ModuleType]:
    """`benchmark/<name>.py` as the module `name` (in `sys.modules` while loaded: dataclasses look their module up).
    On exit every module loaded from `benchmark/` since entry is unloaded and `sys.path` is restored."""
    modules, path = set(sys.modules), list(sys.path)
    spec = importlib.util.spec_from_file_location(name, BENCH_DIR / f'{name}.py')
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        for loaded in set(sys.modules) - modules:
            file = getattr(sys.modules[loaded], '__file__', None)
            if loaded == name or (file and Path(file).parent == BENCH_DIR):
                del sys.modules[loaded]
        sys.path[:] = path
