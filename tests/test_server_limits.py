"""Limits of the RPC socket (``engine/server/_server.py``): connections, idle time, request size.

Each is a setting (``EngineConfig`` and a ``serve`` option); over a limit the peer gets one error line
saying which and the connection is closed, and the engine goes on serving everyone else.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.server._client import AsyncEngineClient, EngineClient, EngineConnectionError

from .children import ignoring_sigint, mark
from .serve_support import Served, start_serve


def connect(served: Served) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(served.socket_path)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything until the engine closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def status(sock: socket.socket) -> dict[str, object]:
    sock.sendall(b'{"jsonrpc":"2.0","method":"status","id":1}\n')
    line = b""
    while not line.endswith(b"\n"):
        line += sock.recv(65536)
    answer: dict[str, object] = json.loads(line)
    return answer


def _limited(state_dir: Path, idle_seconds: float) -> Iterator[Served]:
    served = start_serve(
        state_dir,
        "--max-connections", "3", "--idle-seconds", str(idle_seconds), "--max-request-bytes", "4096",
        "--grace-seconds", "2",
    )  # fmt: skip
    yield served
    assert served.stop() == 0
    assert "Traceback" not in served.log()


@pytest.fixture
def limited(tmp_path: Path) -> Iterator[Served]:
    """An engine with small limits: 3 connections, 1 s idle, 4096-byte requests."""
    yield from _limited(tmp_path / "state", 1)


@pytest.fixture
def full(tmp_path: Path) -> Iterator[Served]:
    """The same limits with 30 s idle: held connections stay open while a slow CLI call starts (the
    suite runs two tests at a time; a 1 s idle closed them meanwhile once)."""
    yield from _limited(tmp_path / "state", 30)


def test_connections_over_the_limit_get_an_error_line_and_are_closed(full: Served) -> None:
    held = [connect(full) for _ in range(3)]
    try:
        for sock in held:
            assert "result" in status(sock)  # each is served (and, answered, its idle clock restarts)
        extra = connect(full)
        refused = json.loads(read_all(extra))
        extra.close()
        assert refused["id"] is None and refused["error"]["code"] == -32600
        assert refused["error"]["message"].startswith("too many connections: the engine serves at most 3")
        listed = full.cli("list")  # a person is told in words, not shown the bytes (found by a new user)
        assert listed.returncode == 1
        refusal = "gadget-engine: the engine refused the connection: too many connections: the engine serves"
        assert listed.stderr.startswith(refusal), listed.stderr

        held.pop().close()
        time.sleep(0.1)
        again = connect(full)
        assert "result" in status(again)
        again.close()
    finally:
        for sock in held:
            sock.close()
    assert "event=connection_refused" in full.log() and "limit=3" in full.log()


def test_a_refusal_is_read_by_a_client_that_writes_after_it_was_sent(full: Served) -> None:
    """A refused connection is closed as a lingering close does (the engine's write side, then what the
    peer sends dropped until it closes, at most a second): a request written after the refusal was sent
    does not break its writer's pipe, and every client reads why it was refused."""
    held = [connect(full) for _ in range(3)]
    try:
        for sock in held:
            assert "result" in status(sock)
        late = connect(full)
        time.sleep(0.3)  # the refusal is sent at once; before, the connection was closed with it
        late.sendall(b'{"jsonrpc":"2.0","method":"status","id":1}\n')  # was: BrokenPipeError
        refused = json.loads(read_all(late))
        late.close()
        assert refused["id"] is None and refused["error"]["message"].startswith("too many connections")

        async def fresh_async_clients() -> list[str]:
            said = []
            for _ in range(10):
                async with AsyncEngineClient(str(full.state_dir)) as client:
                    with pytest.raises(EngineConnectionError) as caught:
                        await client.call("status")
                said.append(str(caught.value))
            return said

        for text in asyncio.run(fresh_async_clients()):
            assert text.startswith("the engine refused the connection: too many connections"), text
    finally:
        for sock in held:
            sock.close()


def test_a_connection_without_a_complete_request_is_closed_when_idle(limited: Served) -> None:
    silent = connect(limited)
    started = time.monotonic()
    closed = json.loads(read_all(silent))
    silent.close()
    assert 0.8 < time.monotonic() - started < 4
    assert closed["error"]["message"].startswith("no request within 1 s")
    trickle = connect(limited)  # a slow trickle does not keep it open either
    started = time.monotonic()
    try:
        for byte in b'{"jsonrpc":"2.0","method":"status"':
            trickle.sendall(bytes([byte]))
            time.sleep(0.1)
    except BrokenPipeError:
        pass
    closed = json.loads(read_all(trickle))
    trickle.close()
    assert closed["error"]["message"].startswith("no complete request within 1 s")
    assert time.monotonic() - started < 6


def test_a_request_being_answered_is_never_idle_and_followers_are_served(
    limited: Served, tmp_path: Path
) -> None:
    project = tmp_path / "app"
    project.mkdir()
    stubborn = limited.cli("create", "--project", str(project), "--", *ignoring_sigint(mark("340.81")))
    pid = stubborn.stdout.strip()
    started = time.monotonic()
    killed = limited.cli("kill", pid)  # the grace (2 s, over the idle 1 s) + a SIGKILL: answered slowly
    assert killed.returncode == 0, killed.stderr
    assert time.monotonic() - started > 1.8
    ticker = (
        "import time\nfor i in range(12):\n    print(f'tick {i}', flush=True); time.sleep(0.25)\n"
        f"# {mark('340.82')}"
    )
    created = limited.cli("create", "--project", str(project), "--", "python3", "-c", ticker)
    followed = limited.cli("log", created.stdout.strip(), "--follow", timeout=30)  # ~3 s, asks every 0.25 s
    assert followed.returncode == 0 and followed.stdout.splitlines()[-1] == "tick 11"
    assert time.monotonic() - started > 2
    with EngineClient(str(limited.state_dir), timeout_seconds=10) as client:  # a kept connection
        client.call("status")
        time.sleep(1.6)  # the engine closed it meanwhile: the client opens another
        assert client.call("status")["pid"] == limited.proc.pid


def test_a_request_over_the_size_limit_is_refused_and_closed(limited: Served) -> None:
    for line in (
        b'{"jsonrpc":"2.0","method":"status","params":{"x":"' + b"a" * 5000 + b'"},"id":1}\n',
        b"b" * 9000,
    ):
        sock = connect(limited)
        try:
            sock.sendall(line)
        except BrokenPipeError:
            pass
        refused = json.loads(read_all(sock))
        sock.close()
        assert refused["error"]["message"].startswith("request larger than 4096 bytes")
    sock = connect(limited)
    assert "result" in status(sock)
    sock.close()
