"""Connection hygiene of `guarded_protocol` on a live uvicorn server (loopback, a trivial app): the header deadline
closes half-open and slowloris connections, idle keep-alive connections are closed, and the connection cap makes
room for new clients by closing the oldest idle connection. Every wait is bounded."""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from lmdeploy.serve.openai.connections import connection_cap, guarded_protocol

TIMEOUT_HEADER = 0.6
KEEP_ALIVE = 0.6
MAX_CONNECTIONS = 5


@pytest.fixture(scope='module')
def server() -> Iterator[tuple[str, type]]:
    app = Starlette(routes=[Route('/ping', lambda request: PlainTextResponse('pong'))])
    protocol = guarded_protocol(MAX_CONNECTIONS, TIMEOUT_HEADER)
    sock = socket.socket()
    sock.bind(('127.0.0.1', 0))
    config = uvicorn.Config(app, http=protocol, timeout_keep_alive=KEEP_ALIVE, log_level='warning')
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={'sockets': [sock]}, daemon=True)
    thread.start()
    url = f'http://127.0.0.1:{sock.getsockname()[1]}'
    deadline = time.monotonic() + 10
    while True:
        try:
            httpx.get(f'{url}/ping', timeout=1)
            break
        except httpx.TransportError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    yield url, protocol
    srv.should_exit = True
    thread.join(timeout=10)


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix('http://').split(':')
    return socket.create_connection((host, int(port)), timeout=5)


def _closed_after(sock: socket.socket, limit: float) -> float:
    """Seconds until the server closes `sock` (reads and discards anything it sends)."""
    start = time.monotonic()
    sock.settimeout(limit)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - start


def test_connection_that_sends_nothing_is_closed_at_the_header_deadline(server):
    url, _ = server
    with _connect(url) as sock:
        waited = _closed_after(sock, 5)
    assert TIMEOUT_HEADER - 0.1 <= waited < TIMEOUT_HEADER + 2


def test_slowloris_headers_are_cut_at_the_deadline_despite_trickling_bytes(server):
    url, protocol = server
    before = protocol.guard.num_header_timeouts
    head = b'GET /ping HTTP/1.1\r\nHost: x\r\nX-Slow: ' + b'a' * 100
    with _connect(url) as sock:
        start = time.monotonic()
        closed = False
        for byte in head:   # one byte every 50 ms: 6 s for the whole head, far past the deadline
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            time.sleep(0.05)
            if time.monotonic() - start > TIMEOUT_HEADER + 2:
                break
        if not closed:
            closed = _closed_after(sock, 2) < 2
    assert closed and time.monotonic() - start < TIMEOUT_HEADER + 3
    assert protocol.guard.num_header_timeouts > before


def test_idle_keep_alive_connection_is_closed(server):
    url, _ = server
    with _connect(url) as sock:
        sock.sendall(b'GET /ping HTTP/1.1\r\nHost: x\r\n\r\n')
        assert sock.recv(4096).startswith(b'HTTP/1.1 200')
        waited = _closed_after(sock, 5)
    assert waited < KEEP_ALIVE + 2


def test_cap_closes_the_oldest_idle_connection_for_a_new_client(server):
    url, protocol = server
    before = protocol.guard.num_evicted
    idle = [_connect(url) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.1)
        assert httpx.get(f'{url}/ping', timeout=5).text == 'pong'   # a sixth connection gets in
        assert protocol.guard.num_evicted >= before + 1
        assert _closed_after(idle[0], 2) < 2   # the oldest made room
    finally:
        for sock in idle:
            sock.close()


def test_cap_fits_the_descriptor_limit():
    import resource
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert connection_cap(10**9) < soft
    assert connection_cap(7) == min(7, connection_cap(10**9))


@pytest.mark.parametrize('soft,backlog', [(1024, 64), (4096, None), (65536, 2048)])
def test_backlog_scales_with_the_descriptor_limit_and_the_cap_keeps_its_bursts_free(monkeypatch, soft, backlog):
    """The accept bursts in flight (`_BURSTS_IN_FLIGHT` of the backlog) stay free below the limit, whatever it is."""
    from lmdeploy.serve.openai import connections
    monkeypatch.setattr(connections.resource, 'getrlimit', lambda _: (soft, soft))
    free = connections._descriptors_free()
    got = connections.accept_backlog()
    assert got == (backlog if backlog is not None else free // 16)
    cap = connections.connection_cap(10**9, got)
    assert cap == free - connections._BURSTS_IN_FLIGHT * got
    assert cap + connections._BURSTS_IN_FLIGHT * got + connections._RESERVED_FDS < soft


def test_no_descriptor_limit_keeps_the_configured_cap(monkeypatch):
    from lmdeploy.serve.openai import connections
    monkeypatch.setattr(connections.resource, 'getrlimit', lambda _: (connections.resource.RLIM_INFINITY,) * 2)
    assert connections.accept_backlog() == 2048 and connections.connection_cap(4096) == 4096


@pytest.mark.parametrize('soft,hard,want', [(1024, 4096, 4096), (1024, 10**6, 65536), (1024, 1024, 1024),
                                            (100_000, 10**6, 100_000)])
def test_the_soft_descriptor_limit_is_raised_towards_the_hard_one(monkeypatch, soft, hard, want):
    from lmdeploy.serve.openai import connections
    calls = []
    monkeypatch.setattr(connections.resource, 'getrlimit', lambda _: (soft, hard))
    monkeypatch.setattr(connections.resource, 'setrlimit', lambda _, limits: calls.append(limits))
    assert connections.raise_descriptor_limit() == want
    assert calls == ([(want, hard)] if want != soft else [])


def test_a_refused_raise_keeps_the_limit(monkeypatch):
    from lmdeploy.serve.openai import connections

    def refuse(*_):
        raise ValueError('not allowed')
    monkeypatch.setattr(connections.resource, 'getrlimit', lambda _: (1024, 4096))
    monkeypatch.setattr(connections.resource, 'setrlimit', refuse)
    assert connections.raise_descriptor_limit() == 1024
