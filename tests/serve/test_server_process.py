"""`lmdeploy serve api_server` as a process on loopback, with its descriptor limit set to 1,024 (RLIMIT_NOFILE in
the child): 1,100 half-open connections do not stop normal requests; SIGTERM with long streams in flight drains,
aborts the rest at the grace deadline with OpenAI error bodies and exits 0 within the grace period; a second
signal aborts at once. Every wait is bounded in time and every loop in count."""
from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import NamedTuple

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lmdeploy.serve.openai.lifecycle import exit_reserve

MODEL = 'tiny-qwen3'
FD_LIMIT = 1024
LONG = {'model': MODEL, 'prompt': [5, 6, 7, 8], 'max_tokens': 100_000, 'ignore_eos': True, 'temperature': 0,
        'stream': True}


class Process(NamedTuple):
    proc: subprocess.Popen
    url: str

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f'{self.url}/metrics', timeout=10).text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


def _limit_descriptors() -> None:  # in the child, before exec
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


def start_server(model_path: str, *flags: str) -> Process:
    port = _free_port()
    cmd = [sys.executable, '-m', 'lmdeploy.cli.entrypoint', 'serve', 'api_server', model_path, '--device', 'cpu',
           '--server-port', str(port), '--model-name', MODEL, '--num-gpu-blocks', '512', '--cache-block-seq-len',
           '16', '--max-batch-size', '8', '--log-level', 'warning', *flags]
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'TOKENIZERS_PARALLELISM': 'false'}
    proc = subprocess.Popen(cmd, env=env, preexec_fn=_limit_descriptors, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    url = f'http://127.0.0.1:{port}'
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        try:
            if httpx.get(f'{url}/health', timeout=1).status_code == 200:
                return Process(proc, url)
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, 'server did not come up'
        time.sleep(0.2)


def stop(process: Process) -> None:
    if process.proc.poll() is None:
        process.proc.kill()
    process.proc.wait(timeout=30)


@pytest.fixture(scope='module')
def model_path(tiny_model_factory) -> str:
    return tiny_model_factory('qwen3')


class Stream:
    """A streaming completion read on its own thread."""

    def __init__(self, url: str, body: dict):
        self.events: list = []
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict) -> None:
        try:
            with httpx.stream('POST', f'{url}/v1/completions', json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith('data: '):
                        self.events.append(line[6:] if line == 'data: [DONE]' else json.loads(line[6:]))
        except httpx.HTTPError as exc:
            self.error = repr(exc)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), 'stream still open'


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f'timed out waiting for {what}'
        time.sleep(0.05)
    return value


def test_half_open_connections_at_the_descriptor_limit_and_sigterm_drain(model_path):
    process = start_server(model_path, '--timeout-header', '60', '--timeout-graceful-shutdown', '4')
    try:
        _half_open_connections(process)
        _sigterm_with_long_streams(process)
    finally:
        stop(process)
    # accept() never ran out of descriptors (asyncio logs it, then stops accepting for a second at a time)
    log = process.proc.stdout.read().decode()
    assert 'out of system resource' not in log, log[-3000:]


def _half_open_connections(process: Process) -> None:
    host, port = process.url.removeprefix('http://').split(':')
    held: list[socket.socket] = []
    start = time.monotonic()
    try:
        for i in range(1100):   # more than the server's descriptors; half of them send half a request line
            sock = socket.create_connection((host, int(port)), timeout=5)
            if i % 2:
                sock.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\n')
            held.append(sock)
        opened = time.monotonic() - start
        latencies = []
        with httpx.Client() as client:
            for i in range(20):
                t0 = time.monotonic()
                response = client.post(f'{process.url}/v1/completions', timeout=10,
                                       json={'model': MODEL, 'prompt': [5, 6, i + 7], 'max_tokens': 2},
                                       headers={'Connection': 'close'})
                latencies.append(time.monotonic() - t0)
                assert response.status_code == 200, response.text
        assert httpx.get(f'{process.url}/health', timeout=10).status_code == 200
        m = process.metrics()
        assert m['lmdeploy:http_connections_max'] < FD_LIMIT
        assert m['lmdeploy:http_connections_evicted_total'] >= 1100 - m['lmdeploy:http_connections_max']
        print(f'\n1,100 half-open connections (opened in {opened:.2f} s) at a {FD_LIMIT}-descriptor limit: '
              f'20/20 normal requests served, max latency {max(latencies) * 1000:.0f} ms; connection cap '
              f'{m["lmdeploy:http_connections_max"]:.0f}, {m["lmdeploy:http_connections_evicted_total"]:.0f} evicted')
    finally:
        for sock in held:
            sock.close()
    assert process.proc.poll() is None


def _sigterm_with_long_streams(process: Process) -> None:
    grace = 4.0   # the rest is aborted at grace - exit_reserve(grace) = 2 s
    streams = [Stream(process.url, LONG) for _ in range(3)]
    short = Stream(process.url, {**LONG, 'max_tokens': 20})
    wait_for(lambda: all(len(s.events) >= 2 for s in streams), 30, 'streams running')
    start = time.monotonic()
    process.proc.send_signal(signal.SIGTERM)
    health = wait_for(lambda: (h := httpx.get(f'{process.url}/health', timeout=5)).status_code == 503 and h, 5,
                      '/health 503')
    assert health.json()['status'] == 'draining'
    refused = httpx.post(f'{process.url}/v1/completions', json={'model': MODEL, 'prompt': [5], 'max_tokens': 2},
                         timeout=5)
    assert refused.status_code == 503 and refused.json()['error']['code'] == 'server_shutting_down'
    code = process.proc.wait(timeout=grace + 20)
    elapsed = time.monotonic() - start
    for s in streams + [short]:
        s.join(10)
    print(f'SIGTERM with 3 long streams: exit {code} after {elapsed:.2f} s (grace {grace:g} s)')
    assert code == 0, process.proc.stdout.read().decode()[-3000:]
    assert grace - exit_reserve(grace) <= elapsed <= grace, f'exited {elapsed:.2f} s after SIGTERM'
    assert short.error is None and short.events[-1] == '[DONE]'
    assert short.events[-2]['choices'][0]['finish_reason'] == 'length'   # drained: finished within the grace
    for s in streams:
        assert s.error is None and s.events[-1] == '[DONE]', s.events[-3:]
        error = s.events[-2]['error']
        assert error['code'] == 'server_shutting_down' and error['type'] == 'service_unavailable'
        assert set(error) == {'message', 'type', 'param', 'code'}


def test_second_signal_aborts_at_once(model_path):
    process = start_server(model_path, '--timeout-graceful-shutdown', '120')
    try:
        streams = [Stream(process.url, LONG) for _ in range(2)]
        plain = []
        waiter = threading.Thread(target=lambda: plain.append(httpx.post(
            f'{process.url}/v1/completions', json={**LONG, 'stream': False}, timeout=60)), daemon=True)
        waiter.start()
        wait_for(lambda: all(len(s.events) >= 2 for s in streams), 30, 'streams running')
        process.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        start = time.monotonic()
        process.proc.send_signal(signal.SIGINT)
        code = process.proc.wait(timeout=20)
        elapsed = time.monotonic() - start
        waiter.join(10)
        for s in streams:
            s.join(10)
        print(f'\nSIGTERM then SIGINT: exit {code} {elapsed:.2f} s after the second signal (grace 120 s)')
        assert code == 0 and elapsed < 6
        for s in streams:
            assert s.events[-1] == '[DONE]' and s.events[-2]['error']['code'] == 'server_shutting_down'
        assert plain[0].status_code == 503 and plain[0].json()['error']['code'] == 'server_shutting_down'
    finally:
        stop(process)


def test_exit_code_says_the_engine_died():
    from types import SimpleNamespace

    import uvicorn

    from lmdeploy.serve.openai.lifecycle import ExitCode, GracefulServer
    from lmdeploy.serve.watchdog import Liveness
    watchdog = SimpleNamespace(state=Liveness.OK)
    server = GracefulServer(uvicorn.Config(app=None), None, SimpleNamespace(draining=False, in_flight=0), watchdog,
                            grace=1.0)
    assert server.exit_code() is ExitCode.OK
    watchdog.state = Liveness.DEAD
    assert server.exit_code() is ExitCode.ENGINE_DEAD and int(ExitCode.ENGINE_DEAD) == 1
    server.handle_exit(15, None)   # the first signal starts the drain, a second one moves the deadline to now
    first = server.deadline
    assert server.admission.draining and first is not None
    server.handle_exit(2, None)
    assert server.deadline <= first
