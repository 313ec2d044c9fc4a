"""The stdlib clients, sync and asyncio, in a process where Trio cannot be imported, against a real serve.

The client modules (``engine.server._client`` with ``_protocol``, ``_location`` and ``engine._errors``)
import only the standard library. ``engine/__init__.py`` imports Trio, so the script loads them the way
the guardian loads ``engine._guardian`` (``engine._guardian.BOOTSTRAP``): under a bare ``engine`` package
module, without running the package's ``__init__``, with the recipe of ``docs/rpc.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import engine
from engine import (
    AsyncEngineClient,
    EngineClient,
    EngineNotRunningError,
    EngineSocketMissingError,
    EngineStoppingError,
    EngineSuspendedError,
)
from engine.server._location import find_socket_path

from .children import kill_leftovers
from .serve_support import cli, start_serve, wait_until

#: What the script refuses to import: Trio and every third-party package the engine itself uses.
BLOCKED = ("trio", "trio_util", "outcome", "sniffio", "attrs", "platformdirs", "cronsim")

SCRIPT = r"""
import asyncio, importlib.util, json, sys, types
for name in sys.argv[4].split(","):
    sys.modules[name] = None
# The recipe of docs/rpc.md.
spec = importlib.util.find_spec("engine")
package = types.ModuleType("engine")
package.__path__ = list(spec.submodule_search_locations)
sys.modules["engine"] = package
report = {"package": package.__path__ == [sys.argv[1]]}

from engine._errors import EngineError, InvalidScheduleError, SubProcessNotFoundError
from engine.server._client import (
    AsyncEngineClient, EngineClient, EngineConnectionError, EngineNotRunningError, RpcError,
)

state, project, marker = sys.argv[2], sys.argv[3], sys.argv[5]


def expect(error_type, call):
    try:
        call()
    except error_type as exc:
        return type(exc).__name__
    raise AssertionError(f"expected {error_type.__name__}")


async def aexpect(error_type, awaitable):
    try:
        await awaitable
    except error_type as exc:
        return type(exc).__name__
    raise AssertionError(f"expected {error_type.__name__}")


with EngineClient(state, timeout_seconds=30) as client:
    report["sync_status_pid"] = client.call("status")["pid"]
    sp = client.call("subprocess.create", project=project, command="sleep", args=[marker])
    report["sync_listed"] = [r["pid"] for r in client.call("subprocess.list")] == [sp["pid"]]
    report["sync_kill"] = client.call("subprocess.kill", pid=sp["pid"])["stopped"]
    kill = lambda: client.call("subprocess.kill", pid=sp["pid"])
    report["sync_not_found"] = expect(SubProcessNotFoundError, kill)
    report["sync_lookup"] = expect(LookupError, lambda: client.call("subprocess.halt", pid=sp["pid"]))
    bad = {"kind": "cron", "expr": "not cron"}
    payload = {"kind": "system_event", "text": "x"}
    report["sync_schedule"] = expect(
        InvalidScheduleError, lambda: client.call("cron.add", schedule=bad, payload=payload)
    )
    report["sync_rpc_code"] = expect(RpcError, lambda: client.call("no.such.method"))
nobody = EngineClient(state + "-none")
report["sync_not_running"] = expect(EngineNotRunningError, lambda: nobody.call("status"))


async def main():
    async with AsyncEngineClient(state) as client:
        report["async_status_pid"] = (await client.call("status"))["pid"]
        sp = await client.call("subprocess.create", project=project, command="sleep", args=[marker])
        log = await client.call("subprocess.read_log", pid=sp["pid"])
        report["async_log_running"] = log["running"]
        # Calls from several tasks share the connection, one at a time.
        many = await asyncio.gather(*(client.call("subprocess.summarize", pid=sp["pid"]) for _ in range(5)))
        report["async_gather"] = [m["pid"] for m in many] == [sp["pid"]] * 5
        # A cancelled call drops the connection; the next call reconnects.
        call = asyncio.ensure_future(client.call("subprocess.halt", pid=sp["pid"]))
        await asyncio.sleep(0)
        call.cancel()
        report["async_cancelled"] = await aexpect(asyncio.CancelledError, call)
        report["async_repr_after_cancel"] = repr(client)
        summary = await client.call("subprocess.summarize", pid=sp["pid"])
        report["async_after_cancel"] = summary["pid"] == sp["pid"]
        report["async_kill"] = (await client.call("subprocess.kill", pid=sp["pid"]))["pid"] == sp["pid"]
        report["async_not_found"] = await aexpect(
            SubProcessNotFoundError, client.call("subprocess.kill", pid=sp["pid"])
        )
        report["async_engine_error"] = await aexpect(EngineError, client.call("cron.remove", job_id="nope"))
        report["async_rpc_code"] = await aexpect(RpcError, client.call("subprocess.kill", pid="x"))
    report["async_not_running"] = await aexpect(
        EngineNotRunningError, AsyncEngineClient(state + "-none").call("status")
    )


asyncio.run(main())
report["blocked_stayed_out"] = all(sys.modules.get(name) is None for name in sys.argv[4].split(","))
print(json.dumps(report))
"""


def test_clients_work_without_trio_against_a_real_serve(tmp_path: Path, project: Path, marker: str) -> None:
    state = tmp_path / "state"
    served = start_serve(state)
    try:
        result = subprocess.run(
            [
                sys.executable,
                "-c",
                SCRIPT,
                str(Path(engine.__file__).parent),
                str(state),
                str(project),
                ",".join(BLOCKED),
                marker,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)
        assert report == {
            "package": True,
            "sync_status_pid": served.proc.pid,
            "sync_listed": True,
            "sync_kill": True,
            "sync_not_found": "SubProcessNotFoundError",
            "sync_lookup": "SubProcessNotFoundError",
            "sync_schedule": "InvalidScheduleError",
            "sync_rpc_code": "RpcError",
            "sync_not_running": "EngineNotRunningError",
            "async_status_pid": served.proc.pid,
            "async_log_running": True,
            "async_gather": True,
            "async_cancelled": "CancelledError",
            "async_repr_after_cancel": f"<AsyncEngineClient {str(state)!r}: not connected>",
            "async_after_cancel": True,
            "async_kill": True,
            "async_not_found": "SubProcessNotFoundError",
            "async_engine_error": "JobNotFoundError",
            "async_rpc_code": "RpcError",
            "async_not_running": "EngineNotRunningError",
            "blocked_stayed_out": True,
        }
        with served.client() as client:
            assert client.call("subprocess.list") == []
    finally:
        served.stop()
        kill_leftovers(marker)


def test_client_modules_import_only_the_standard_library() -> None:
    """The source of every module on the clients' import path names no third-party package."""
    root = Path(engine.__file__).parent
    for module in ("server/_client.py", "server/_protocol.py", "server/_location.py", "_errors.py"):
        source = (root / module).read_text()
        top_level = [line for line in source.splitlines() if line.startswith(("import ", "from "))]
        for line in top_level:
            assert not any(f" {name}" in line for name in BLOCKED), (module, line)


def test_both_clients_name_an_engine_whose_process_is_stopped(tmp_path: Path) -> None:
    # Found by a new user: with the engine stopped (SIGSTOP, Ctrl-Z in its terminal) every call waited for
    # its answer forever.
    served = start_serve(tmp_path / "state")
    pid = served.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        with EngineClient(str(served.state_dir)) as client:
            t0 = time.monotonic()
            with pytest.raises(EngineSuspendedError) as info:
                client.call("status")
            assert time.monotonic() - t0 < 10  # about a second; a loose bound, to catch a hang
            assert info.value.pid == pid
            assert f"(pid {pid}) is stopped" in str(info.value) and f"kill -CONT {pid}" in str(info.value)

        async def call() -> None:
            async with AsyncEngineClient(str(served.state_dir)) as client:
                await client.call("status")

        with pytest.raises(EngineSuspendedError):
            asyncio.run(asyncio.wait_for(call(), 10))
    finally:
        os.kill(pid, signal.SIGCONT)
    with EngineClient(str(served.state_dir)) as client:  # continued, it answers as before
        assert client.call("status")["pid"] == pid
    assert served.stop() == 0


def _plant(path: Path, kind: str, elsewhere: Path) -> None:
    """Put something that is not a socket at ``path``: a ``kind`` of file, or a link to one."""
    if kind == "directory":
        path.mkdir()
    elif kind == "regular file":
        path.write_text("not a socket\n")
    elif kind == "FIFO":
        os.mkfifo(path)
    elif kind == "symbolic link to a directory":
        elsewhere.mkdir()
        path.symlink_to(elsewhere)
    else:
        assert kind == "symbolic link that leads to nothing"
        path.symlink_to(elsewhere)


@pytest.mark.parametrize(
    "kind",
    [
        "directory",
        "regular file",
        "FIFO",
        "symbolic link to a directory",
        "symbolic link that leads to nothing",
    ],
)
def test_client_names_what_is_at_the_socket_path_when_no_engine_runs(tmp_path: Path, kind: str) -> None:
    # Found by a reviewer: a directory, file or FIFO at engine.sock was "nothing answers ... start one
    # with: gadget-engine start" (and start then refused it); with an engine running, "is stopping".
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    path = Path(find_socket_path(str(state)))
    _plant(path, kind, tmp_path / "elsewhere")
    try:
        for command in ("list", "status"):
            done = cli(command, "--state-dir", str(state))
            assert done.returncode == 3, done  # no engine runs: the CLI's "no engine" code
            assert done.stderr.splitlines() == [
                f"gadget-engine: {path} is a {kind}, not an engine's socket, and no engine is running on "
                f"{state}: remove it (serve refuses to start beside it); start one with: gadget-engine "
                f"--state-dir {state} start"
            ]
        with pytest.raises(EngineNotRunningError, match=f"is a {kind}, not an engine's socket"):
            EngineClient(str(state)).call("status")

        async def call() -> None:
            async with AsyncEngineClient(str(state)) as client:
                await client.call("status")

        with pytest.raises(EngineNotRunningError, match=f"is a {kind}, not an engine's socket"):
            asyncio.run(asyncio.wait_for(call(), 10))
    finally:
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        else:
            path.unlink()


def test_client_names_a_directory_at_a_running_engines_socket_path(tmp_path: Path) -> None:
    # Found by a reviewer: every command said the engine "is stopping and no longer answers" (and stop
    # waited 30 s for a stop that never came). The engine cannot bind its socket over a directory.
    served = start_serve(tmp_path / "state")
    pid = served.proc.pid
    path = Path(served.socket_path)
    try:
        # The engine binds its socket again as soon as its file goes: plant until the directory stays.
        assert wait_until(lambda: _replace_with_directory(path))
        # start too: it waited --wait-seconds for an answer that cannot come, then timed out
        for command in ("list", "status", "start"):
            done = served.cli(command)
            assert done.returncode == 1, done  # an engine runs: 3 would say none does
            assert done.stderr.splitlines() == [
                f"gadget-engine: {path} is a directory, not an engine's socket: the engine on "
                f"{served.state_dir} (pid {pid}) cannot be reached through it; remove it, and the engine "
                "binds its socket there again within 5 s"
            ]
        with pytest.raises(EngineSocketMissingError, match="is a directory, not an engine's socket") as info:
            EngineClient(str(served.state_dir)).call("status")
        assert info.value.pid == pid and not isinstance(info.value, EngineStoppingError)
        path.rmdir()  # what the message says to do
        assert wait_until(lambda: served.cli("status").returncode == 0, 15)
    finally:
        if path.is_dir():
            path.rmdir()
        assert served.stop() == 0


def _replace_with_directory(path: Path) -> bool:
    """Replace the socket at ``path`` with a directory; whether a directory is there now."""
    with contextlib.suppress(FileNotFoundError, IsADirectoryError):
        path.unlink()
    with contextlib.suppress(FileExistsError):
        path.mkdir()
    return path.is_dir()


def test_client_follows_a_link_to_a_socket_as_before(tmp_path: Path) -> None:
    """A symbolic link to a socket is connected through as it was: to a socket nobody listens on, "no
    engine is running"; to a live engine's that is not the state directory's, refused by its peer."""
    refusing = tmp_path / "refusing"
    refusing.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX) as unlistened:
        unlistened.bind(str(refusing / "engine.sock"))  # closed unlistened: a connect is refused
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    link = Path(find_socket_path(str(state)))
    link.symlink_to(refusing / "engine.sock")
    done = cli("list", "--state-dir", str(state))
    assert (done.returncode, done.stderr) == (
        3,
        f"gadget-engine: no engine is running on {state} (nothing answers on {link}); start one with: "
        f"gadget-engine --state-dir {state} start\n",
    )
    served = start_serve(tmp_path / "served")
    try:
        link.unlink()
        link.symlink_to(served.socket_path)
        done = cli("list", "--state-dir", str(state))
        assert done.returncode == 1, done
        assert f"not by the engine of {state} (no engine runs there)" in done.stderr, done.stderr
    finally:
        assert served.stop() == 0


def test_client_call_watching_ends_when_the_output_reader_goes(tmp_path: Path) -> None:
    served = start_serve(tmp_path / "state")
    read_end, write_end = os.pipe()
    try:
        client = EngineClient(str(served.state_dir), timeout_seconds=30)
        with client, open(os.devnull, "wb") as null:
            # A reader that stays, or a descriptor with none (a file): the call waits out its seconds.
            began = time.monotonic()
            assert client.call_watching(write_end, "events.wait", since=10**9, seconds=0.5) == []
            assert client.call_watching(null.fileno(), "events.wait", since=10**9, seconds=0.5) == []
            assert time.monotonic() - began >= 1.0
            os.close(read_end)
            read_end = -1
            began = time.monotonic()
            with pytest.raises(BrokenPipeError):
                client.call_watching(write_end, "events.wait", since=10**9, seconds=30)
            took = time.monotonic() - began
            assert took < 5, took  # at once; loose, to catch a wait of the call's 30 s
            assert repr(client).endswith(": not connected>")  # its answer would come out of turn
            assert client.call("status")["pid"] == served.proc.pid  # the next call reconnects
    finally:
        os.close(write_end)
        if read_end >= 0:
            os.close(read_end)
        assert served.stop() == 0
