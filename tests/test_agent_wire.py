"""Issues 17 and 18 on the wire: RPC (``subprocess.create`` with ``stdin``/``ready``/``restart``/
``notify_on_exit``, ``subprocess.input``, ``subprocess.wait``, ``read_log`` with ``new_only``/``grep``),
the CLI (``create --stdin --ready-log --ready-port --ready-timeout --restart --max-restarts
--notify-on-exit``, ``input``, ``wait``, ``log --new --grep``) and the asyncio wrapper, against a real
``gadget-engine serve``."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest

from engine import EngineConfig, ReadyCheck, open_asyncio_engine
from engine.server._client import RpcError
from engine.server._protocol import INVALID_PARAMS

from .children import PY, kill_leftovers, mark
from .serve_support import Served, wait_until


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_rpc_create_ready_input_wait_and_read_log_new_and_grep(served: Served, project: Path) -> None:
    with served.client() as client:
        # one write of the whole line: print() writes the text and the newline apart when unbuffered
        # (PYTHONUNBUFFERED=1 here), and readiness may match the prompt between the two
        code = (
            "import sys; sys.stdout.write('name?\\n'); sys.stdout.flush(); "
            "print('hello', sys.stdin.readline().strip())"
        )
        summary = client.call(
            "subprocess.create",
            project=str(project),
            command=PY,
            args=["-c", code],
            stdin=True,
            ready={"log": "name\\?", "timeout": 20},
        )
        pid = summary["pid"]
        assert (summary["ready"], summary["first_output"]) == ("ready", "name?\n")
        sent = client.call("subprocess.input", pid=pid, text="world\n", eof=True)
        assert sent == {"pid": pid, "sent": 6, "eof": True}
        done = client.call("subprocess.wait", pid=pid, timeout_seconds=20)
        assert (done["finished"], done["status"]) == (True, "exited 0")
        new = client.call("subprocess.read_log", pid=pid, new_only=True, reader="rpc-test")
        assert new["text"] == "name?\nhello world\n" and new["skipped_bytes"] == 0
        again = client.call("subprocess.read_log", pid=pid, new_only=True, reader="rpc-test")
        assert again["text"] == ""
        found = client.call("subprocess.read_log", pid=pid, grep="^hello")
        assert found["text"] == "2: hello world\n"
        with pytest.raises(RpcError) as bad:
            client.call("subprocess.wait", pid=pid, timeout_seconds=301)
        assert bad.value.code == INVALID_PARAMS and "at most 300" in str(bad.value)
        with pytest.raises(RpcError) as bad:
            client.call("subprocess.create", project=str(project), command="true", ready={"port": 0})
        assert bad.value.code == INVALID_PARAMS and "ready.port" in str(bad.value)


def test_cli_create_ready_port_input_wait_log_new_grep(served: Served, project: Path) -> None:
    port = _free_port()
    marker = mark("73.1")
    try:
        out = served.cli(
            "create",
            "--project",
            str(project),
            "--ready-port",
            str(port),
            "--ready-timeout",
            "20",
            "--",
            PY,
            "-u",
            "-X",
            f"pycache_prefix=/tmp/m{marker}",
            "-m",
            "http.server",
            str(port),
            "--bind",
            "127.0.0.1",
        )
        assert out.returncode == 0, out.stderr
        server = int(out.stdout)
        assert out.stderr == "ready: ready\n"
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            conn.sendall(b"GET /missing HTTP/1.0\r\n\r\n")
            conn.recv(100)
        assert served.cli("log", str(server), "--stream", "stderr", "--new").returncode == 0
        assert wait_until(
            lambda: (
                "404" in served.cli("log", str(server), "--stream", "stderr", "--grep", "GET /missing").stdout
            )
        )
        killed = served.cli("kill", str(server))
        assert killed.returncode == 0
    finally:
        kill_leftovers(marker)

    out = served.cli("create", "--project", str(project), "--stdin", "--", "cat")
    cat = int(out.stdout)
    assert served.cli("input", str(cat), "first").returncode == 0
    assert served.cli("input", str(cat), "second", "--eof").returncode == 0
    waited = served.cli("wait", str(cat), "--timeout", "20")
    assert (waited.returncode, waited.stdout) == (0, "exited 0\n")
    assert served.cli("log", str(cat), "--new").stdout == "first\nsecond\n"
    assert served.cli("log", str(cat), "--new").stdout == ""
    assert served.cli("log", str(cat), "--grep", "sec").stdout == "2: second\n"
    late = served.cli("input", str(cat), "third")
    assert late.returncode == 1 and "the input was ended (eof)" in late.stderr

    # A process that does not read: the CLI's input is bounded as the tool's is (found by a new user).
    deaf = int(served.cli("create", "--project", str(project), "--stdin", "--", "sleep", mark("73.3")).stdout)
    try:
        blocked = served.cli("input", str(deaf), "x" * 100_000, timeout=25)
        assert blocked.returncode == 1, blocked
        assert f"pid {deaf} did not read its stdin within 10 s (its pipe is full)" in blocked.stderr
        assert served.cli("list").returncode == 0  # the engine goes on
    finally:
        served.cli("kill", str(deaf))

    sleeper = int(served.cli("create", "--project", str(project), "--", "sleep", mark("73.2")).stdout)
    try:
        still = served.cli("wait", str(sleeper), "--timeout", "0.2")
        assert still.returncode == 1 and "still running after 0.2 s" in still.stderr
        as_json = served.cli("wait", str(sleeper), "--timeout", "0.1", "--json")
        assert json.loads(as_json.stdout)["finished"] is False
        usage = served.cli("log", str(sleeper), "--new", "-f")
        assert usage.returncode == 2
        usage = served.cli("create", "--project", str(project), "--ready-timeout", "3", "--", "true")
        assert usage.returncode == 2 and "--ready-timeout goes with" in usage.stderr
    finally:
        served.cli("kill", str(sleeper))


def test_asyncio_wrapper_stdin_ready_wait_and_new_reads(tmp_path: Path, project: Path) -> None:
    async def main() -> None:
        async with open_asyncio_engine(EngineConfig(state_dir=str(tmp_path / "state"))) as engine:
            summary = await engine.create(
                project, "bash", ["-c", "echo up; read x; echo got $x"], stdin=True, ready=ReadyCheck("up")
            )
            assert summary.ready == "ready"
            await engine.write_stdin(summary.pid, "it\n")
            async with asyncio.timeout(10):
                done = await engine.wait(summary.pid)
            assert done.status == "exited 0"
            assert (await engine.read_log(summary.pid, new_only=True)).text == "up\ngot it\n"
            assert (await engine.read_log(summary.pid, grep="got")).text == "2: got it\n"

    asyncio.run(main())


def test_cli_and_rpc_restart_policy(served: Served, project: Path) -> None:
    out = served.cli(
        "create",
        "--project",
        str(project),
        "--restart",
        "on-failure",
        "--max-restarts",
        "1",
        "--",
        "bash",
        "-c",
        "exit 3",
    )
    assert out.returncode == 0, out.stderr
    first = int(out.stdout)
    waited = served.cli("wait", str(first), "--timeout", "30")
    assert waited.stdout == "crash loop: 1 restarts in 60 s; its last run exited 3\n"
    again = served.cli(
        "create", "--project", str(project), "--restart", "always", "--", "bash", "-c", "exit 0"
    )
    assert again.returncode == 0, again
    backing_off = int(again.stdout)

    def waiting_to_restart() -> bool:
        rows = [json.loads(line) for line in served.cli("list", "--json").stdout.splitlines()]
        return any(r["first_pid"] == backing_off and r["status"].startswith("restarting") for r in rows)

    assert wait_until(waiting_to_restart)
    halted = served.cli("halt", str(backing_off))  # found by a new user: it did not say the restart was off
    assert (
        halted.stdout == f"{backing_off} had already stopped; its restart is called off; its logs are kept\n"
    )
    listed = [json.loads(line) for line in served.cli("list", "--json").stdout.splitlines()]
    mine = [r for r in listed if r["first_pid"] == first]
    assert [(r["restarts"], r["last_exit"]) for r in mine] == [(1, "exited 3")]
    with served.client() as client:
        summary = client.call(
            "subprocess.create",
            project=str(project),
            command="true",
            restart={"mode": "always", "max_restarts": 0},
        )
        done = client.call("subprocess.wait", pid=summary["pid"], timeout_seconds=20)
        assert (done["finished"], done["status"]) == (True, "exited 0")  # max_restarts=0: not a crash loop
        with pytest.raises(RpcError) as bad:
            client.call("subprocess.create", project=str(project), command="true", restart={"mode": "maybe"})
        assert bad.value.code == INVALID_PARAMS
    usage = served.cli("create", "--project", str(project), "--max-restarts", "2", "--", "true")
    assert usage.returncode == 2
    too_many = served.cli(
        "create", "--project", str(project), "--restart", "on-failure", "--max-restarts", "1001", "--", "true"
    )  # the engine's bound, a usage error too
    assert too_many.returncode == 2 and "from 0 to 1000" in too_many.stderr, too_many
