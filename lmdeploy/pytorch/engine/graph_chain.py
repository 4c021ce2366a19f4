"""Prefill CUDA graphs as a chain of graphs split at decoder-layer boundaries (`CUDAGraphRunner` captures and
replays them; `cuda_graph.py`).

Why: the device starts a graph only when its launch returns, and a launch costs the host about 1 us per node, so one
whole-model graph left the device idle for the whole launch (~1 ms for the Qwen3.5-9B shape's ~1,080 nodes, H200
run 19). Split after 2 and 10 layers (`split_layers`, `LMDEPLOY_GRAPH_SPLIT`), the device starts after a 2-layer
launch, and each later launch runs while the device works through the graph before it (2 layers' work hides an
8-layer launch, 8 layers' work the rest; run 22: the device busy 0.86 ms of a 1.13 ms launch). Decode graphs stay
whole: under async scheduling their launch overlaps the step before.

How: the model calls `StepContext.after_layer(i)` after decoder layer i (every model's layer loop does); during a
split capture that ends the graph being captured and begins the next one in the same memory pool. The tensors one
piece hands the next (hidden states, residual, per-forward metadata) stay allocated in the pool while the next is
captured, and a later replay of another key may reuse their memory only after the whole chain ran: the rule one
graph's temporaries follow, since replays never interleave.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable

import torch

from ..model_inputs import StepContext

# Decoder layer counts after which a prefill graph ends and the next one begins (see the module docstring).
DEFAULT_GRAPH_SPLIT = (2, 10)


def split_layers() -> tuple[int, ...]:
    """Layer counts after which prefill graphs split: `LMDEPLOY_GRAPH_SPLIT` (comma-separated positive ints,
    e.g. '2,10'; '0' or empty: one graph per key), default `DEFAULT_GRAPH_SPLIT`."""
    raw = os.environ.get('LMDEPLOY_GRAPH_SPLIT')
    if raw is None:
        return DEFAULT_GRAPH_SPLIT
    parts = [p.strip() for p in raw.split(',') if p.strip()]
    if not all(p.isdigit() for p in parts):
        raise ValueError(f'LMDEPLOY_GRAPH_SPLIT must be comma-separated layer counts (e.g. 2,10), got {raw!r}')
    return tuple(sorted({int(p) for p in parts} - {0}))


class GraphChain:
    """Graphs captured back to back in one memory pool that replay in order as one forward."""

    def __init__(self, graphs: list[torch.cuda.CUDAGraph]):
        self.graphs = graphs

    def replay(self) -> None:
        for graph in self.graphs:
            graph.replay()

    def __len__(self) -> int:
        return len(self.graphs)


def capture_chain(model: Callable[[StepContext], torch.Tensor], ctx: StepContext, pool, stream: torch.cuda.Stream,
                  splits: tuple[int, ...]) -> tuple[GraphChain, torch.Tensor]:
    """`model(ctx)` captured as a chain of graphs into `pool`, split after each layer count in `splits`. Begins as
    `torch.cuda.graph` does: synchronise, empty the allocator's cache, capture on `stream`."""
    graphs = [torch.cuda.CUDAGraph()]
    at = set(splits)

    def after_layer(i: int) -> None:
        if i + 1 in at:
            graphs[-1].capture_end()
            graphs.append(torch.cuda.CUDAGraph())
            graphs[-1].capture_begin(pool, capture_error_mode='thread_local')

    torch.cuda.synchronize(stream.device)
    torch.cuda.empty_cache()
    with torch.cuda.stream(stream):
        graphs[0].capture_begin(pool, capture_error_mode='thread_local')
        try:
            out = model(dataclasses.replace(ctx, after_layer=after_layer))
        except BaseException:
            with contextlib.suppress(Exception):  # leave the stream out of capture; the model's error stands
                graphs[-1].capture_end()
            raise
        graphs[-1].capture_end()
    return GraphChain(graphs), out
