"""The process groups of one tensor-parallel engine (one host): rendezvous, devices, environment, teardown.

Every rank (rank 0 in the engine process, ranks 1..tp-1 in the workers it spawns) calls `init_rank` with the same
`DistInit`: `init_process_group` at `tcp://127.0.0.1:PORT` (a port free at engine start), gloo on CPU, NCCL on CUDA
with rank r on `cuda:r`. The group is the default (world) group of the process, so one process holds at most one
tensor-parallel engine at a time (a second one is refused by name until the first is closed).

NVLink multicast stays off in every process (`MULTICAST_OFF`, set before any group exists): the multi-GPU
machines here require it, and NCCL reads it at communicator creation.
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
from dataclasses import dataclass

import torch

MULTICAST_OFF = {'NCCL_NVLS_ENABLE': '0', 'TORCH_SYMM_MEM_DISABLE_MULTICAST': '1', 'NVSHMEM_DISABLE_NVLS': '1'}
# Collectives (and the rendezvous) give up after this long instead of waiting forever on a peer that stopped
# answering; a peer process that exits is noticed at once (gloo: the connection closes; NCCL: the engine's worker
# monitor aborts the group).
DEFAULT_TIMEOUT_S = 300.0


def disable_multicast() -> None:
    os.environ.update(MULTICAST_OFF)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class DistInit:
    tp: int
    port: int
    device_type: str                  # 'cpu' (gloo) or 'cuda' (NCCL)
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def backend(self) -> str:
        return 'nccl' if self.device_type == 'cuda' else 'gloo'

    def device_of(self, rank: int) -> torch.device:
        return torch.device('cuda', rank) if self.device_type == 'cuda' else torch.device('cpu')


def check_can_start(init: DistInit) -> None:
    """Refuse before spawning anything: a process group already in this process, or too few GPUs."""
    import torch.distributed as dist
    if dist.is_initialized():
        raise RuntimeError('a tensor-parallel engine (or another torch.distributed group) is already running in this '
                           'process; close it before starting another with tp > 1')
    if init.device_type == 'cuda' and torch.cuda.device_count() < init.tp:
        raise ValueError(f'tp={init.tp} needs {init.tp} GPUs, {torch.cuda.device_count()} visible')


def init_rank(init: DistInit, rank: int):
    """Join the group as `rank`; returns the group the model's all-reduces use (the world group)."""
    import torch.distributed as dist
    disable_multicast()
    device = init.device_of(rank)
    kwargs = {}
    if device.type == 'cuda':
        torch.cuda.set_device(device)
        kwargs['device_id'] = device
    dist.init_process_group(init.backend, init_method=f'tcp://127.0.0.1:{init.port}', rank=rank,
                            world_size=init.tp, timeout=datetime.timedelta(seconds=init.timeout_s), **kwargs)
    return dist.group.WORLD


def abort_group() -> None:
    """Unblock this process's pending collectives after a peer died (NCCL would otherwise wait for its timeout)."""
    import torch.distributed as dist
    abort = getattr(dist.distributed_c10d, '_abort_process_group', None)
    if dist.is_initialized() and abort is not None and dist.get_backend() == 'nccl':
        abort()


def destroy_rank() -> None:
    """Leave the group (idempotent); a group broken by a dead peer may fail to tear down cleanly: logged only."""
    import torch.distributed as dist
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # the process must still be able to start another engine or exit
            logging.getLogger('lmdeploy').exception('leaving the tensor-parallel group failed')
