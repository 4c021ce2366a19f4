"""Load and fault figures of `lmdeploy serve api_server` (docs/reliability.md, "Load and faults").

Starts the server as a child process on loopback (tiny random-weight hybrid Qwen3.5, prefix caching on, CPU,
RLIMIT_NOFILE 1,024 in the child) and drives it with hostile traffic, printing one line per scenario:
oversized bodies, a far too long prompt, 100,000 stop strings, a lone surrogate in `model`, a tiny request's
latency beside large prompts, 1,100 half-open connections, a burst beyond the admission limit, SIGTERM with long
streams in flight, and SIGTERM followed by SIGINT. Every loop is bounded in count and every wait in time.

    python benchmark/bench_server_faults.py [--burst 600] [--streams 16] [--device cuda]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

from lmdeploy.bench.http_load import latency_beside_storm

MODEL = 'tiny'
FD_LIMIT = 1024
LONG = {'model': MODEL, 'prompt': [5, 6, 7, 8], 'max_tokens': 100_000, 'ignore_eos': True, 'temperature': 0,
        'stream': True}


# ---- the server process --------------------------------------------------------------------------------------
class Server:
    device = 'cpu'

    def __init__(self, model_path: str, *flags: str):
        with socket.socket() as sock:
            sock.bind(('127.0.0.1', 0))
            port = sock.getsockname()[1]
        cmd = [sys.executable, '-m', 'lmdeploy.cli.entrypoint', 'serve', 'api_server', model_path,
               '--device', self.device, '--server-port', str(port), '--model-name', MODEL, '--num-gpu-blocks', '1024',
               '--cache-block-seq-len', '16', '--max-batch-size', '8', '--enable-prefix-caching',
               '--prefix-cache-state-budget', '4', '--log-level', 'error', *flags]
        env = {**os.environ, 'OMP_NUM_THREADS': '1', 'TOKENIZERS_PARALLELISM': 'false'}
        limit = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))  # noqa: E731
        self.proc = subprocess.Popen(cmd, env=env, preexec_fn=limit, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        self.url = f'http://127.0.0.1:{port}'
        deadline = time.monotonic() + 180
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f'server exited with {self.proc.returncode}')
            try:
                if httpx.get(f'{self.url}/health', timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError('server did not come up')
            time.sleep(0.2)

    def memory(self) -> tuple[int, int]:
        """(RSS, peak RSS) of the server process in MiB."""
        with open(f'/proc/{self.proc.pid}/status') as f:
            values = {k: int(v.split()[0]) for k, v in (line.split(':', 1) for line in f) if k in ('VmRSS', 'VmHWM')}
        return values['VmRSS'] >> 10, values['VmHWM'] >> 10

    def post(self, path: str, body, timeout: float = 60) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(f'{self.url}/v1/{path}', content=content, timeout=timeout,
                          headers={'Content-Type': 'application/json'})

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def report(name: str, **figures) -> None:
    print(f'{name:<28} ' + ', '.join(f'{k}={v}' for k, v in figures.items()), flush=True)


# ---- scenarios -----------------------------------------------------------------------------------------------
def oversized_body(server: Server) -> None:
    host, port = server.url.removeprefix('http://').split(':')
    piece = b'x' * (1 << 20)
    chunk = b'%x\r\n' % len(piece) + piece + b'\r\n'
    _, peak_before = server.memory()
    sent, start = 0, time.monotonic()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n'
                     b'Transfer-Encoding: chunked\r\n\r\n')
        try:
            for _ in range(50):
                sock.sendall(chunk)
                sent += len(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass
        elapsed = time.monotonic() - start
        try:
            reply = sock.recv(200)
        except ConnectionError:
            reply = b''
    _, peak_after = server.memory()
    report('50 MiB chunked body', status=reply[9:12].decode() or 'closed', refused_after_ms=round(elapsed * 1000),
           sent_mib=sent >> 20, peak_rss_growth_mib=peak_after - peak_before)
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 52428800\r\n\r\n{')
        reply = sock.recv(200)
    report('50 MiB Content-Length', status=reply[9:12].decode(), ms=round((time.monotonic() - start) * 1000))


def long_prompt(server: Server) -> None:
    _, peak_before = server.memory()
    body = {'model': MODEL, 'max_tokens': 2, 'messages': [{'role': 'user', 'content': 'waves ' * 1_300_000}]}
    start = time.monotonic()
    response = server.post('chat/completions', body)
    report('7.4 MiB prompt', status=response.status_code, code=response.json()['error']['code'],
           ms=round((time.monotonic() - start) * 1000), peak_rss_growth_mib=server.memory()[1] - peak_before)


def stop_strings(server: Server) -> None:
    start = time.monotonic()
    response = server.post('completions', {'model': MODEL, 'prompt': 'x', 'stop': [f'w{i}' for i in range(100_000)]})
    report('100,000 stop strings', status=response.status_code, param=response.json()['error']['param'],
           ms=round((time.monotonic() - start) * 1000))
    response = server.post('completions', {'model': MODEL, 'prompt': 'x', 'max_tokens': 2,
                                           'stop': [f'w{i}' for i in range(16)]})
    report('16 stop strings', status=response.status_code)


def surrogate_model(server: Server) -> None:
    response = server.post('chat/completions',
                           b'{"model": "tiny\\ud800", "messages": [{"role": "user", "content": "x"}]}')
    report('lone surrogate in model', status=response.status_code, param=response.json()['error']['param'])


def tiny_beside_large(server: Server) -> None:
    big = json.dumps({'model': MODEL, 'max_tokens': 1,
                      'messages': [{'role': 'user', 'content': 'tide and sea ' * 80_000}]}).encode()   # ~1 MiB
    baseline, loaded, statuses = latency_beside_storm(server.url, MODEL, big, num_threads=8, num_samples=15,
                                                      max_sent=2000)
    report('tiny beside 8x 1 MiB prompts', baseline_median_ms=round(statistics.median(baseline) * 1000, 1),
           loaded_median_ms=round(statistics.median(loaded) * 1000, 1), loaded_max_ms=round(max(loaded) * 1000, 1),
           large_prompts=len(statuses), large_statuses=sorted(set(statuses)))


def half_open(server: Server) -> None:
    host, port = server.url.removeprefix('http://').split(':')
    held, latencies = [], []
    try:
        for i in range(1100):
            sock = socket.create_connection((host, int(port)), timeout=5)
            if i % 2:
                sock.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\n')
            held.append(sock)
        ok = 0
        with httpx.Client() as client:
            for i in range(50):
                start = time.perf_counter()
                try:
                    response = client.post(f'{server.url}/v1/completions', timeout=10,
                                           json={'model': MODEL, 'prompt': [5, 6, i + 7], 'max_tokens': 2},
                                           headers={'Connection': 'close'})
                    ok += response.status_code == 200
                except httpx.HTTPError:
                    pass
                latencies.append(time.perf_counter() - start)
        text = httpx.get(f'{server.url}/metrics', timeout=10).text
    finally:
        for sock in held:
            sock.close()
    metrics = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
               if line.startswith('lmdeploy:http_')}
    report('1,100 half-open connections', fd_limit=FD_LIMIT, normal_ok=f'{ok}/50',
           p50_ms=round(statistics.median(latencies) * 1000), max_ms=round(max(latencies) * 1000),
           cap=int(metrics['lmdeploy:http_connections_max']),
           evicted=int(metrics['lmdeploy:http_connections_evicted_total']))


def burst(server: Server, n: int) -> None:
    async def run():
        limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits, timeout=120) as client:
            async def one(i):
                start = time.perf_counter()
                response = await client.post(f'{server.url}/v1/completions',
                                             json={'model': MODEL, 'prompt': [5, 6, 7, i % 500 + 8],
                                                   'max_tokens': 8, 'ignore_eos': True})
                return response.status_code, time.perf_counter() - start, response.headers.get('retry-after')
            return await asyncio.gather(*(one(i) for i in range(n)))

    start = time.perf_counter()
    results = asyncio.run(run())
    wall = time.perf_counter() - start
    ok = sorted(t for s, t, _ in results if s == 200)
    refused = sorted(t for s, t, _ in results if s == 429)
    report(f'{n} simultaneous requests', admitted_limit=64, ok=len(ok), refused_429=len(refused),
           other=len(results) - len(ok) - len(refused), retry_after=sorted({r for s, _, r in results if s == 429}),
           ok_p99_s=round(ok[int(0.99 * (len(ok) - 1))], 2) if ok else None,
           refusal_p99_ms=round(refused[int(0.99 * (len(refused) - 1))] * 1000) if refused else None,
           wall_s=round(wall, 1))
    response = httpx.post(f'{server.url}/v1/completions', json={'model': MODEL, 'prompt': [5, 6], 'max_tokens': 2},
                          timeout=30)
    report('request after the burst', status=response.status_code)


class Stream(threading.Thread):
    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body, self.events, self.error = url, body, [], None
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream('POST', f'{self.url}/v1/completions', json=self.body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith('data: '):
                        self.events.append(line[6:] if line == 'data: [DONE]' else json.loads(line[6:]))
        except httpx.HTTPError as exc:
            self.error = repr(exc)


def sigterm(model_path: str, num_streams: int, grace: float, second_signal: bool) -> None:
    # a batch that holds every stream, so that none finishes (session length) while others wait
    server = Server(model_path, '--timeout-graceful-shutdown', str(grace), '--max-batch-size', str(num_streams))
    try:
        streams = [Stream(server.url, LONG) for _ in range(num_streams)]
        deadline = time.monotonic() + 60
        while not all(len(s.events) >= 2 for s in streams) and time.monotonic() < deadline:
            time.sleep(0.05)
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        if second_signal:
            time.sleep(0.5)
            server.proc.send_signal(signal.SIGINT)
        code = server.proc.wait(timeout=grace + 30)
        elapsed = time.monotonic() - start
        for s in streams:
            s.join(10)
        done = sum(bool(s.events) and s.events[-1] == '[DONE]' for s in streams)
        errors = sum(len(s.events) >= 2 and isinstance(s.events[-2], dict) and 'error' in s.events[-2]
                     and s.events[-2]['error']['code'] == 'server_shutting_down' for s in streams)
        name = f'SIGTERM{"+SIGINT" if second_signal else ""}, {num_streams} streams'
        report(name, grace_s=grace, exit_code=code, exit_after_s=round(elapsed, 2), done=f'{done}/{num_streams}',
               openai_error_event=f'{errors}/{num_streams}', client_errors=sum(s.error is not None for s in streams))
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--burst', type=int, default=600)
    parser.add_argument('--streams', type=int, default=16)
    parser.add_argument('--device', default='cpu', choices=['cpu', 'cuda'])
    args = parser.parse_args()
    Server.device = args.device
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(soft, 4096), hard), hard))   # the client's own sockets
    from lmdeploy.demo_model import save_tiny_model
    model_path = save_tiny_model(tempfile.mkdtemp(prefix='bench-server-'), arch='qwen3_5')
    server = Server(model_path)
    try:
        for scenario in (oversized_body, long_prompt, stop_strings, surrogate_model, tiny_beside_large, half_open):
            scenario(server)
        burst(server, args.burst)
        report('server still up', health=httpx.get(f'{server.url}/health', timeout=10).status_code)
    finally:
        server.stop()
    sigterm(model_path, args.streams, grace=5.0, second_signal=False)
    sigterm(model_path, args.streams, grace=60.0, second_signal=True)


if __name__ == '__main__':
    main()
