"""Rank 0's handle on the tensor-parallel workers of one engine: spawn, start-up handshake, step dispatch, liveness,
shutdown.

- Start (`TPWorkers.start`): NVLink multicast off in this process (inherited by the children), one
  `torch.multiprocessing` spawn process per rank 1..tp-1 (daemonic: they die with the engine process), each with a
  command pipe and a report pipe. Rank 0 waits for every worker's 'hello' before joining the process group, then
  for every 'built' (free device memory after its weights) before sizing the pools: `min_free_bytes` is the
  minimum over ranks. Every wait watches the workers' exit sentinels: a worker that dies during start-up makes the
  start fail with its error, never hang.
- Steps (`send`): one pickled command, written to every worker's pipe before rank 0 runs its own part. The
  payload travels by pipe, not by a collective: a worker waiting for the next step must be able to wait forever
  on an idle engine (a collective has a timeout) and must notice at once that the engine process is gone (the pipe
  closes). Collectives carry only the model's all-reduces.
- Liveness: a monitor thread waits on the workers' sentinels. A worker that exits while the engine runs sets
  `error` (rank, pid, exit code and the traceback it reported), aborts this process's pending collectives (NCCL;
  gloo fails them by itself when the peer's connection closes) and calls `on_failure` (the engine wakes and fails
  every request). After a failure the group is broken for good: every later `send` raises `TensorParallelFailure`.
- `close`: 'stop' to every worker, join (terminate, then kill, after a grace period), leave the group. Idempotent;
  also run when the handle is garbage collected, so no worker outlives its engine.
"""
from __future__ import annotations

import logging
import pickle
import threading
import weakref
from collections.abc import Callable
from multiprocessing.connection import wait

import torch.multiprocessing as mp

from .tp_dist import DistInit, abort_group, check_can_start, destroy_rank, disable_multicast, free_port, init_rank
from .tp_worker import WorkerSpec, worker_main

logger = logging.getLogger('lmdeploy')
START_TIMEOUT_S = 600.0   # a worker's imports plus its share of the weights
JOIN_TIMEOUT_S = 10.0


class TensorParallelFailure(RuntimeError):
    """A rank of the tensor-parallel group failed or exited: the engine cannot run another forward."""


class _Worker:
    def __init__(self, rank: int, process, commands, reports):
        self.rank, self.process, self.commands, self.reports = rank, process, commands, reports
        self.reported_error: str | None = None
        # Every wait on the process (join, exit code, is_alive) holds this: two threads reaping one `multiprocessing`
        # process race in `waitpid`, and the loser reads the exit code as None (the monitor thread and a failed
        # step both describe a dead worker).
        self._reap = threading.Lock()

    def wait_exit(self, timeout_s: float = JOIN_TIMEOUT_S) -> int | None:
        """The exit code once the process has exited; None if it still runs after `timeout_s`."""
        with self._reap:
            self.process.join(timeout_s)
            return self.process.exitcode

    def stop(self) -> None:
        """Join; after a grace period terminate, then kill (the caller has sent 'stop')."""
        with self._reap:
            self.process.join(JOIN_TIMEOUT_S)
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(JOIN_TIMEOUT_S)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()

    def describe_exit(self) -> str:
        """Why a worker that is gone (or going: its pipe closed, its sentinel fired) stopped: waits for its exit."""
        code = self.wait_exit()
        what = f'tensor-parallel worker rank {self.rank} (pid {self.process.pid}) exited with code {code}'
        try:
            while self.reported_error is None and self.reports.poll():
                msg = self.reports.recv()
                if msg[0] == 'error':
                    self.reported_error = msg[1]
        except (EOFError, OSError):
            pass
        return what + (f': {self.reported_error.strip()}' if self.reported_error else '')


class TPWorkers:

    def __init__(self, init: DistInit, workers: list[_Worker]):
        self.init = init
        self.workers = workers
        self.error: str | None = None
        self.on_failure: Callable[[], None] | None = None
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._monitor: threading.Thread | None = None
        self.min_free_bytes = 0
        self.group = None   # rank 0's process group (the model's all-reduces)
        self._finalizer = weakref.finalize(self, _close_workers, workers, self._closing)

    # ---- start-up ---------------------------------------------------------------------------------------------
    @classmethod
    def start(cls, tp: int, device_type: str, spec: WorkerSpec, timeout_s: float | None = None) -> TPWorkers:
        """Spawn ranks 1..tp-1 and join the group as rank 0 (this process). Returns once every worker has built its
        model shard; the caller then builds rank 0's (`build_rank_model`) and calls `finish_start`."""
        init = DistInit(tp=tp, port=free_port(), device_type=device_type,
                        **({'timeout_s': timeout_s} if timeout_s else {}))
        check_can_start(init)
        disable_multicast()
        ctx = mp.get_context('spawn')
        workers = []
        for rank in range(1, tp):
            cmd_recv, cmd_send = ctx.Pipe(duplex=False)
            rep_recv, rep_send = ctx.Pipe(duplex=False)
            process = ctx.Process(target=worker_main, args=(rank, init, spec, cmd_recv, rep_send), daemon=True,
                                  name=f'lmdeploy-tp{rank}')
            process.start()
            cmd_recv.close()
            rep_send.close()
            workers.append(_Worker(rank, process, cmd_send, rep_recv))
        self = cls(init, workers)
        try:
            self._await('hello')
            self.group = init_rank(init, 0)
        except BaseException:
            self.close()
            raise
        return self

    def finish_start(self, rank0_free_bytes: int) -> int:
        """Wait for every worker's model; returns the minimum free device memory over all ranks."""
        try:
            frees = [msg[1] for msg in self._await('built')]
        except BaseException:
            self.close()
            raise
        self.min_free_bytes = min([rank0_free_bytes, *frees])
        return self.min_free_bytes

    def setup(self, agent_spec) -> None:
        """Workers build their pools and agents; then the monitor starts watching them."""
        self.send(('setup', agent_spec))
        self._await('ready')
        self._monitor = threading.Thread(target=self._watch, name='lmdeploy-tp-monitor', daemon=True)
        self._monitor.start()

    def _await(self, kind: str, timeout_s: float = START_TIMEOUT_S) -> list:
        """One `kind` report from every worker (in rank order); `TensorParallelFailure` when one dies or reports an
        error first, or nothing comes within the timeout."""
        replies: dict[int, tuple] = {}
        pending = {w.reports: w for w in self.workers}
        sentinels = {w.process.sentinel: w for w in self.workers}
        while pending:
            ready = wait([*pending, *sentinels], timeout=timeout_s)
            if not ready:
                raise self.fail(f'tensor-parallel workers gave no {kind!r} within {timeout_s:.0f} s')
            for obj in ready:
                if obj in pending:
                    worker = pending[obj]
                    try:
                        msg = worker.reports.recv()
                    except (EOFError, OSError):
                        raise self.fail(worker.describe_exit()) from None
                    if msg[0] == 'error':
                        worker.reported_error = msg[1]
                        raise self.fail(worker.describe_exit())
                    if msg[0] == kind:
                        replies[worker.rank] = msg
                        del pending[obj]
                elif obj in sentinels and sentinels[obj].reports not in ready:
                    raise self.fail(sentinels[obj].describe_exit())
        return [replies[w.rank] for w in self.workers]

    # ---- steps ------------------------------------------------------------------------------------------------
    def send(self, command: tuple) -> None:
        """Queue `command` on every worker, in order; `TensorParallelFailure` when the group is broken."""
        if self.error is not None:
            raise TensorParallelFailure(self.error)
        data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        for worker in self.workers:
            try:
                worker.commands.send_bytes(data)
            except OSError:
                raise self.fail(self._dead_worker_message(f'the pipe to rank {worker.rank} broke')) from None

    def query_state(self) -> list[list[dict]]:
        """Every worker's state pool views (rank order); for tests."""
        self.send(('state',))
        return [msg[1] for msg in self._await('state')]

    def fail(self, message: str) -> TensorParallelFailure:
        """Mark the group broken with `message` (the first failure wins); returns the error to raise."""
        with self._lock:
            if self.error is None:
                self.error = message
                logger.error('tensor parallelism failed: %s', message)
                abort_group()
        if self.on_failure is not None:
            self.on_failure()
        return TensorParallelFailure(self.error)

    def fail_from(self, exc: BaseException) -> TensorParallelFailure:
        """Rank 0 raised inside a step: blame a worker that died (its collective failed first), else rank 0."""
        return self.fail(self._dead_worker_message(f'rank 0 failed inside a tensor-parallel step: {exc}'))

    def _dead_worker_message(self, fallback: str, grace_s: float = 2.0) -> str:
        if self.error is not None:
            return self.error
        dead = wait([w.process.sentinel for w in self.workers], timeout=grace_s)
        for worker in self.workers:
            if worker.process.sentinel in dead:
                return worker.describe_exit()
        return fallback

    def _watch(self) -> None:
        sentinels = {w.process.sentinel: w for w in self.workers}
        while not self._closing.is_set():
            ready = wait(list(sentinels), timeout=0.5)
            if ready and not self._closing.is_set():
                self.fail(sentinels[ready[0]].describe_exit())
                return

    # ---- shutdown ---------------------------------------------------------------------------------------------
    def close(self) -> None:
        """After a failure rank 0 leaves the group first, so a worker stuck in a collective fails it at once
        instead of waiting to be terminated."""
        self._closing.set()
        if self.error is not None:
            destroy_rank()
        self._finalizer()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=JOIN_TIMEOUT_S)
        destroy_rank()


def _close_workers(workers: list[_Worker], closing: threading.Event) -> None:
    closing.set()
    stop = pickle.dumps(('stop',))
    for worker in workers:
        try:
            worker.commands.send_bytes(stop)
        except OSError:
            pass
    for worker in workers:
        worker.stop()
        for conn in (worker.commands, worker.reports):
            conn.close()
