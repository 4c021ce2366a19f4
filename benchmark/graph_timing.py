"""Device time of a callable from CUDA-graph replays: no host launch cost in the figure (`bench_moe_kernel.py`,
`bench_decode_gemms.py`)."""
from __future__ import annotations

import torch


def graph_us(fn, calls: int, reps: int = 20) -> float:
    """Device microseconds per call of `fn(i)`: calls i = 0..calls-1 (e.g. one per weight copy, so that none is read
    from L2 twice) captured in one CUDA graph, replayed `reps` times after one untimed replay."""
    for i in range(calls):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1e3 / (reps * calls)
    del graph
    return us
