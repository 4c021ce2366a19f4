"""A safetensors checkpoint folder: its shard files, the tensors' headers, and a parallel, memory-bounded reader.

`Checkpoint.tensor_infos()` reads only the JSON headers (names, dtypes, shapes), so a load can be planned and
validated before any weight is read. `Checkpoint.iter_tensors()` reads tensors on a few worker threads (safetensors
releases the GIL while it reads) and hands them to the caller in completion order; a byte budget bounds how much
read-but-not-yet-consumed data exists at once (one tensor larger than the budget is read alone). A tensor's bytes
count against the budget until the caller asks for the next tensor, so the caller must copy it (into a device
parameter) before it moves on. A progress bar (tqdm, shown on terminals only) counts bytes.
"""
from __future__ import annotations

import json
import os
import queue
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch
from safetensors import safe_open

_INDEX_FILE = 'model.safetensors.index.json'
_DTYPES = {'F64': torch.float64, 'F32': torch.float32, 'BF16': torch.bfloat16, 'F16': torch.float16,
           'F8_E4M3': torch.float8_e4m3fn, 'F8_E5M2': torch.float8_e5m2, 'I64': torch.int64, 'I32': torch.int32,
           'I16': torch.int16, 'I8': torch.int8, 'U8': torch.uint8, 'BOOL': torch.bool}
DEFAULT_NUM_WORKERS = 4
DEFAULT_BUDGET_BYTES = 2 << 30


class TensorInfo(NamedTuple):
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize


def _read_header(path: str) -> dict[str, TensorInfo]:
    with open(path, 'rb') as f:
        length = int.from_bytes(f.read(8), 'little')
        header = json.loads(f.read(length))
    infos = {}
    for name, entry in header.items():
        if name == '__metadata__':
            continue
        dtype = _DTYPES.get(entry['dtype'])
        if dtype is None:
            raise ValueError(f'{os.path.basename(path)}: tensor {name!r} has unsupported dtype {entry["dtype"]}')
        infos[name] = TensorInfo(path, dtype, tuple(entry['shape']))
    return infos


class _ByteBudget:
    """Blocks `acquire(n)` until `n` more bytes fit under the limit (always admits one request when idle)."""

    def __init__(self, limit: int):
        self._limit = limit
        self._used = 0
        self._cond = threading.Condition()

    def acquire(self, nbytes: int, stop: threading.Event) -> bool:
        with self._cond:
            while self._used and self._used + nbytes > self._limit and not stop.is_set():
                self._cond.wait(0.1)
            if stop.is_set():
                return False
            self._used += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self._cond:
            self._used -= nbytes
            self._cond.notify_all()


class Checkpoint:
    """The safetensors files of a model folder (one file, or the shards of `model.safetensors.index.json`)."""

    def __init__(self, model_path: str):
        self.model_path = model_path
        index = os.path.join(model_path, _INDEX_FILE)
        if os.path.isfile(index):
            with open(index) as f:
                names = sorted(set(json.load(f)['weight_map'].values()))
        else:
            names = sorted(f for f in os.listdir(model_path) if f.endswith('.safetensors'))
        if not names:
            raise ValueError(f'no *.safetensors weights in {model_path!r}')
        self.files = [os.path.join(model_path, name) for name in names]
        missing = [f for f in self.files if not os.path.isfile(f)]
        if missing:
            raise ValueError(f'{_INDEX_FILE} names shard files that are missing: '
                             f'{[os.path.basename(f) for f in missing]}')
        self._infos: dict[str, TensorInfo] | None = None

    def tensor_infos(self) -> dict[str, TensorInfo]:
        """name -> (file, dtype, shape) of every tensor, from the headers alone."""
        if self._infos is None:
            infos: dict[str, TensorInfo] = {}
            for path in self.files:
                for name, info in _read_header(path).items():
                    if name in infos:
                        raise ValueError(f'tensor {name!r} is stored twice ({os.path.basename(infos[name].file)}, '
                                         f'{os.path.basename(path)})')
                    infos[name] = info
            self._infos = infos
        return self._infos

    def iter_tensors(self, num_workers: int = DEFAULT_NUM_WORKERS, budget_bytes: int = DEFAULT_BUDGET_BYTES,
                     progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor as (name, CPU tensor), in completion order; see the module docstring for the memory bound."""
        from tqdm.auto import tqdm
        infos = self.tensor_infos()
        # largest first within each file keeps the workers busy at the end; files in order keeps page-cache locality
        work = iter(sorted(infos.items(), key=lambda item: (item[1].file, -item[1].nbytes)))
        work_lock = threading.Lock()
        budget = _ByteBudget(budget_bytes)
        done: queue.Queue = queue.Queue()
        stop = threading.Event()
        num_workers = max(1, min(num_workers, len(infos)))

        def worker() -> None:
            handles = {}
            try:
                while not stop.is_set():
                    with work_lock:
                        item = next(work, None)
                    if item is None:
                        return
                    name, info = item
                    if not budget.acquire(info.nbytes, stop):
                        return
                    if info.file not in handles:
                        handles[info.file] = safe_open(info.file, framework='pt')
                    done.put((name, handles[info.file].get_tensor(name), info.nbytes))
            except BaseException as err:  # noqa: B036 - handed to the consumer, which re-raises it
                done.put(err)
            finally:
                done.put(None)

        bar = tqdm(total=sum(i.nbytes for i in infos.values()), unit='B', unit_scale=True, desc='Loading weights',
                   disable=None if progress else True, leave=False)
        pool = ThreadPoolExecutor(num_workers, thread_name_prefix='lmdeploy-load')
        try:
            for _ in range(num_workers):
                pool.submit(worker)
            running = num_workers
            while running:
                item = done.get()
                if item is None:
                    running -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                name, tensor, nbytes = item
                del item
                yield name, tensor
                del tensor
                budget.release(nbytes)
                bar.update(nbytes)
        finally:
            stop.set()
            pool.shutdown(wait=True)
            bar.close()
