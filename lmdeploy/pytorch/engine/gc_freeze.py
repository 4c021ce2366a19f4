"""Keep Python's cyclic garbage collector off the start-up heap of a serving process.

A full (generation-2) collection stops every thread and walks every object the collector tracks. After start-up
that is hundreds of thousands of objects (torch, transformers, the tokenizer, the model's modules), none of which is
ever garbage; the engine's own steady state allocates mostly acyclic objects that reference counting frees. Yet
the objects a serving process keeps (trie nodes, checkpoint records, request records) age into the oldest
generation, and once enough have, Python runs a full collection on whatever step allocates next: a stop of 0.1-0.2
s on a 2-core CPU with the tiny model, 0.24 s on an H100 machine's host (`benchmark/bench_decode_host.py
--no-gc-freeze`, `docs/benchmarks.md`), paid by every request in flight.

`freeze_heap` collects once and then moves every tracked object into the collector's permanent generation
(`gc.freeze`), which later collections skip; objects frozen there are still freed by reference counting, and only
garbage cycles among them wait for `gc.unfreeze`. Serving engines freeze after start-up the same way (vLLM's
engine core, SGLang, TensorRT-LLM). Holders nest: `AsyncEngine` (the server, the chat CLI, the pipeline) freezes
once its engine and loop are built and releases at `close()`, and the heap is unfrozen when the last holder
releases, so a process that builds and closes engines one after another (tests, notebooks) leaves nothing frozen
behind. A tensor-parallel worker process freezes after its start-up and never releases (the process ends with the
engine).

`LMDEPLOY_GC_FREEZE=0` turns it off (read at each call).
"""
from __future__ import annotations

import gc
import logging
import os
import threading
import time

logger = logging.getLogger('lmdeploy')

_lock = threading.Lock()
_holders = 0


def enabled() -> bool:
    return os.environ.get('LMDEPLOY_GC_FREEZE', '1') != '0'


def freeze_heap() -> bool:
    """Collect, then freeze every tracked object (see the module docstring); one more holder. Returns whether it
    froze (False when `LMDEPLOY_GC_FREEZE=0`: then the matching `release_heap` is a no-op too)."""
    global _holders
    if not enabled():
        return False
    with _lock:
        began = time.perf_counter()
        gc.collect()
        gc.freeze()
        _holders += 1
        logger.info('gc: %d start-up objects frozen in %.2f s', gc.get_freeze_count(), time.perf_counter() - began)
    return True


def release_heap(froze: bool) -> None:
    """One holder fewer (`froze`: what its `freeze_heap` returned); the last one unfreezes the heap."""
    global _holders
    if not froze:
        return
    with _lock:
        _holders = max(0, _holders - 1)
        if _holders == 0:
            gc.unfreeze()
