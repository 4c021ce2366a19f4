"""Selects the backend for a device type and scopes it to model construction with a context manager."""
from __future__ import annotations

import contextlib
import contextvars
import importlib
from collections.abc import Iterator

from .base import Backend

# device_type -> module exposing `BACKEND`.
_BACKEND_MODULES = {
    'default': 'lmdeploy.pytorch.backends.default',
    'cpu': 'lmdeploy.pytorch.backends.default',
    'cuda': 'lmdeploy.pytorch.backends.cuda',
}
_current: contextvars.ContextVar[Backend | None] = contextvars.ContextVar('lmdeploy_backend', default=None)


def get_backend(device_type: str = 'default') -> Backend:
    module_name = _BACKEND_MODULES.get(device_type)
    if module_name is None:
        raise ValueError(f'no backend for device type {device_type!r}')
    try:
        return importlib.import_module(module_name).BACKEND
    except ModuleNotFoundError:
        if device_type == 'cuda':
            return importlib.import_module(_BACKEND_MODULES['default']).BACKEND
        raise


def current_backend() -> Backend:
    backend = _current.get()
    return backend if backend is not None else get_backend('default')


@contextlib.contextmanager
def use_backend(device_type: str) -> Iterator[Backend]:
    """Layers built inside this block take their implementations from `device_type`'s backend."""
    token = _current.set(get_backend(device_type))
    try:
        yield _current.get()
    finally:
        _current.reset(token)
