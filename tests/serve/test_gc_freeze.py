"""The start-up heap is frozen out of the garbage collector's full passes while an `AsyncEngine` serves
(`engine/gc_freeze.py`): frozen after construction, unfrozen when the last holder closes, off with
`LMDEPLOY_GC_FREEZE=0`; frozen objects are still freed by reference counting."""
from __future__ import annotations

import gc
import weakref

import pytest

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine import gc_freeze
from lmdeploy.serve.async_engine import AsyncEngine


@pytest.fixture(autouse=True)
def unfrozen():
    """Each test starts with nothing frozen and no holder: every engine built before was closed (one left open
    would keep the heap frozen for the rest of the process)."""
    assert gc_freeze._holders == 0 and gc.get_freeze_count() == 0, 'an AsyncEngine was left open'
    yield
    gc_freeze._holders = 0
    gc.unfreeze()


class _Node:
    pass


def test_holders_nest_and_the_last_release_unfreezes():
    first = gc_freeze.freeze_heap()
    assert first and gc.get_freeze_count() > 0
    assert not any(o is _Node for o in gc.get_objects(generation=2))  # the class now lives in the permanent generation
    second = gc_freeze.freeze_heap()
    gc_freeze.release_heap(second)
    assert gc.get_freeze_count() > 0                      # one holder left
    gc_freeze.release_heap(first)
    assert gc.get_freeze_count() == 0


def test_frozen_objects_are_still_freed_by_reference_counting():
    node = _Node()
    ref = weakref.ref(node)
    froze = gc_freeze.freeze_heap()
    del node
    assert ref() is None
    gc_freeze.release_heap(froze)


def test_off_by_environment(monkeypatch):
    monkeypatch.setenv('LMDEPLOY_GC_FREEZE', '0')
    froze = gc_freeze.freeze_heap()
    assert froze is False and gc.get_freeze_count() == 0
    gc_freeze.release_heap(froze)  # a no-op
    assert gc_freeze._holders == 0


def test_a_serving_engine_holds_the_heap_frozen_until_it_closes(tiny_model_factory):
    engine = AsyncEngine(tiny_model_factory('qwen3'), PytorchEngineConfig(device_type='cpu', block_size=16,
                                                                            num_gpu_blocks=64), model_name='tiny')
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0 and gc_freeze._holders == 1
        # the engine's own start-up objects are among the frozen ones: not in any collectable generation
        assert not any(o is engine.engine.scheduler for g in range(3) for o in gc.get_objects(generation=g))
    finally:
        engine.close()
    assert gc.get_freeze_count() == 0 and gc_freeze._holders == 0
    engine.close()  # a second close releases nothing more
    assert gc_freeze._holders == 0
