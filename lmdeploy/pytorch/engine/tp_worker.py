"""The process of one tensor-parallel rank > 0: builds its shard of the model and of the pools, then applies every
step the engine (rank 0) sends, in order, until told to stop.

Protocol (rank 0's side: `tp_workers.py`). Commands arrive on a pipe as pickled tuples (by value: plain `pickle`,
never shared-memory handles):
- ('setup', AgentSpec): build the `CacheEngine` and `ModelAgent` (the same pool geometry as rank 0);
- ('capture',): capture CUDA graphs (every rank captures the same graphs in the same order: their all-reduces pair);
- ('run', ModelInputs, CacheCheckpointInputs | None): restore copies, the model forward, save copies, exactly as
  rank 0 runs them; no logits and no sampling (rank 0 samples; the sampled tokens reach this rank as the next
  step's `input_ids`);
- ('copy', CacheCheckpointInputs): copies outside a forward;
- ('state',): reply with this rank's state pool views (tests: a rank's restored state against the TP=1 state);
- ('stop',): leave the group and exit 0.
Reports go back on a second pipe: ('hello',) once imported, ('built', free_bytes) once the model is loaded,
('ready',) after setup, ('state', ...) replies, and ('error', text) before exiting 1 on any failure: a rank that
failed cannot rejoin the group's collective order, so it never tries; the engine sees the exit and stops.
A closed command pipe (the engine process is gone) ends the worker too.
"""
from __future__ import annotations

import os
import pickle
import signal
import traceback
from dataclasses import dataclass

import torch

from .gc_freeze import freeze_heap
from .tp_dist import DistInit, destroy_rank, init_rank


@dataclass(frozen=True)
class WorkerSpec:
    model_path: str
    dtype: str
    state_dtype: str = 'float32'
    load_format: str = 'auto'


def worker_main(rank: int, init: DistInit, spec: WorkerSpec, commands, reports) -> None:
    """Entry point of the spawned process (`torch.multiprocessing` spawn). Ctrl-C on a terminal reaches the whole
    process group; the engine decides what it means (stop a reply in `lmdeploy chat`, shut the server down), so a
    worker ignores SIGINT and stops only when told (or when the engine process is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        reports.send(('hello',))
        _serve(rank, init, spec, commands, reports)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the engine process is gone: nothing to report to
    except BaseException:
        try:
            reports.send(('error', f'rank {rank}: {traceback.format_exc(limit=8)}'))
        finally:
            os._exit(1)  # no clean-up that could wait on the broken group
    destroy_rank()


def _serve(rank: int, init: DistInit, spec: WorkerSpec, commands, reports) -> None:
    from ..models.tp_load import build_rank_model
    from ..nn.parallel import attach_tp_group
    from .agent_spec import build_agent
    from .cache_sizing import free_memory_bytes
    group = init_rank(init, rank)
    device = init.device_of(rank)
    model, model_config = build_rank_model(spec.model_path, device, spec.dtype, init.device_type, init.tp, rank,
                                           spec.state_dtype, spec.load_format)
    attach_tp_group(model, group)
    reports.send(('built', free_memory_bytes(device)))
    agent = cache_engine = None
    while True:
        op, *args = pickle.loads(commands.recv_bytes())
        if op == 'stop':
            return
        if op == 'setup':
            cache_engine, agent = build_agent(model, model_config, args[0], device)
            freeze_heap()  # this process serves until the engine stops: its start-up heap stays frozen
            reports.send(('ready',))
        elif op == 'capture':
            agent.capture_cuda_graphs()
            freeze_heap()  # and what the warm-up and the graphs added
        elif op == 'run':
            run_forward(agent, *args)
        elif op == 'copy':
            agent.copy_only(args[0])
        elif op == 'state':
            reports.send(('state', [{k: v.cpu().clone() for k, v in layer.items()}
                                    for layer in cache_engine.state_caches]))
        else:
            raise ValueError(f'unknown tensor-parallel command {op!r}')


@torch.inference_mode()
def run_forward(agent, inputs, cache_inputs) -> None:
    """Rank > 0's part of a forward: what `ModelAgent.forward` does up to the hidden states."""
    inputs, cache_inputs = agent.streams.to_device(inputs, cache_inputs)
    with agent.streams.forward():
        agent.run_model(inputs, cache_inputs)
