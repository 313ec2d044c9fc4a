"""The socket server of ``gadget-engine serve``: location, modes, peer check, stale sockets, restarts."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.server._location import SOCKET_POINTER_NAME, SUN_PATH_MAX

from .children import kill_leftovers, mark
from .conftest import cgroup_unusable
from .serve_support import Served, answers, cli, start_serve, wait_until

NOBODY = 65534


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A directory under /tmp that another user may traverse (mode 0711)."""
    path = Path(tempfile.mkdtemp(prefix="gadget-peer-", dir="/tmp"))
    path.chmod(0o711)
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


def _as_nobody(socket_path: str) -> str:
    """Connect to ``socket_path`` as uid 65534 and send ``status``: EACCES, EOF or ANSWERED."""
    code = (
        "import os, socket, sys\n"
        f"os.setgid({NOBODY}); os.setuid({NOBODY})\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        "try:\n"
        f"    s.connect({socket_path!r})\n"
        "except PermissionError:\n"
        "    print('EACCES'); sys.exit(0)\n"
        "try:\n"
        '    s.sendall(b\'{"jsonrpc":"2.0","method":"status","id":1}\\n\')\n'
        "    data = s.recv(1000)\n"
        "except OSError:\n"
        "    data = b''\n"
        "print('EOF' if not data else 'ANSWERED')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20, check=True)
    return out.stdout.strip()


def test_server_socket_is_0600_in_a_0700_state_dir(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    engine = start_serve(state)
    try:
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
        info = os.lstat(state / "engine.sock")
        assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
        assert not (state / SOCKET_POINTER_NAME).exists()
    finally:
        assert engine.stop() == 0


def test_server_refuses_a_peer_of_another_uid(open_tmp: Path) -> None:
    engine = start_serve(open_tmp / "state")
    try:
        assert _as_nobody(engine.socket_path) == "EACCES"  # the modes alone keep it out
        (open_tmp / "state").chmod(0o711)
        os.chmod(engine.socket_path, 0o666)  # opened on purpose: the SO_PEERCRED check must hold alone
        assert _as_nobody(engine.socket_path) == "EOF"
        assert "event=peer_refused" in engine.log() and f"peer_uid={NOBODY}" in engine.log()
        with engine.client() as client:
            assert client.call("status")["pid"] == engine.proc.pid
    finally:
        assert engine.stop() == 0


def test_server_replaces_the_socket_of_a_killed_engine(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = start_serve(state)
    first.kill_hard()
    assert (state / "engine.sock").exists() and not answers(str(state / "engine.sock"))
    second = start_serve(state)
    try:
        assert "event=stale_socket_replaced" in second.log()
        assert second.cli("list").returncode == 0
    finally:
        assert second.stop() == 0


def test_server_long_state_dir_uses_a_runtime_socket(tmp_path: Path) -> None:
    state = tmp_path / ("deep-" + "x" * 100) / "state"
    state.parent.mkdir()
    assert len(os.fsencode(str(state / "engine.sock"))) > SUN_PATH_MAX
    engine = start_serve(state)
    try:
        named = (state / SOCKET_POINTER_NAME).read_text().strip()
        assert named == engine.socket_path and not named.startswith(str(state))
        assert stat.S_IMODE(os.lstat(named).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(named)).st_mode) == 0o700
        assert engine.cli("list").returncode == 0
    finally:
        assert engine.stop() == 0
    assert not os.path.exists(named) and not (state / SOCKET_POINTER_NAME).exists()


def test_a_copied_state_dir_never_talks_to_the_original_engine(tmp_path: Path) -> None:
    """Found by a new user: ``cp -a`` of a deep state directory copied its ``engine.sock.path``, and every
    command on the copy, ``stop`` included, went to the original's engine. An ``engine.sock`` link to
    another engine's socket did the same."""
    original = tmp_path / ("deep-" + "x" * 100) / "state"
    original.parent.mkdir()
    engine = start_serve(original)
    try:
        copy = original.parent / "copy"
        shutil.copytree(original, copy, symlinks=True, ignore=shutil.ignore_patterns("engine.sock"))
        assert (copy / SOCKET_POINTER_NAME).read_text().strip() == engine.socket_path
        linked = tmp_path / "linked"
        linked.mkdir(mode=0o700)
        os.symlink(engine.socket_path, linked / "engine.sock")
        for state in (copy, linked):
            for command in ("list", "stop"):
                done = cli(command, "--state-dir", str(state))
                assert done.returncode == 1, done
                (line,) = done.stderr.splitlines()
                assert f"not by the engine of {state} (no engine runs there)" in line, line
                assert "remove it, then start the engine again" in line
            argv = ["mcp", "--state-dir", str(state), "--project", str(tmp_path)]
            mcp = subprocess.run(  # forwarding was refused call by call, each with a traceback
                [sys.executable, "-m", "engine", *argv],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert mcp.returncode == 1 and mcp.stdout == "", mcp
            assert "remove it, then start the engine again" in mcp.stderr.splitlines()[-1], mcp.stderr
            assert "Traceback" not in mcp.stderr
        assert engine.proc.poll() is None and engine.cli("list").returncode == 0  # untouched
    finally:
        assert engine.stop() == 0


@pytest.mark.parametrize("containment", ["cgroup", "process-group"])
def test_an_engine_on_a_copied_state_dir_leaves_the_original_engines_processes_alone(
    tmp_path: Path, containment: str
) -> None:
    """Found by a new user: ``start`` on a ``cp -a`` copy of a live engine's state directory swept the
    copied records at start-up and ended the original engine's children (SIGINT, nothing logged)."""
    if containment == "cgroup" and cgroup_unusable():
        pytest.skip(f"no writable cgroup v2 here: {cgroup_unusable()}")
    project = tmp_path / "p"
    project.mkdir()
    original = start_serve(tmp_path / "original", "--containment", containment)
    copy: Served | None = None
    try:
        made = original.cli("create", "--project", str(project), "--", "sleep", mark("311.1"))
        pid = int(made.stdout.split()[0])
        shutil.copytree(
            original.state_dir,
            tmp_path / "copy",
            symlinks=True,
            ignore=shutil.ignore_patterns("engine.sock", "*.log", "lock"),
        )
        copy = start_serve(tmp_path / "copy", "--containment", containment)
        assert "event=sweep_skipped" in copy.log()
        assert os.path.exists(f"/proc/{pid}")
        listed = original.cli("list").stdout
        assert str(pid) in listed and "running" in listed, listed
        assert copy.cli("list").stdout.count("\n") == 1  # the header alone: the copy has no processes
    finally:
        if copy is not None:
            assert copy.stop() == 0
        assert original.stop() == 0
        kill_leftovers(rf"^sleep {mark('311.1')}$")


def test_a_runtime_folder_that_cannot_be_private_is_named_with_why(tmp_path: Path) -> None:
    """Found by a new user: a squatted ``/tmp/gadget-engine-<uid>`` made ``start`` say only "no private
    runtime directory"; the reason now names it (a link, not a folder, another owner)."""
    from engine.server._location import _private_dir

    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "link")
    (tmp_path / "file").write_text("")
    assert _private_dir(str(tmp_path / "link")) == f"{tmp_path / 'link'} is a symbolic link"
    assert _private_dir(str(tmp_path / "file")) == f"{tmp_path / 'file'} is not a folder"
    if os.getuid() == 0:
        (tmp_path / "theirs").mkdir()
        os.chown(tmp_path / "theirs", 65534, 65534)
        assert "is owned by uid 65534, not by this user (uid 0)" in _private_dir(str(tmp_path / "theirs"))
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o755)
    assert _private_dir(str(mine)) == "" and stat.S_IMODE(mine.stat().st_mode) == 0o700


def test_server_events_fired_unwatched_survive_a_restart_once_each(tmp_path: Path) -> None:
    state = tmp_path / "state"
    engine = start_serve(state)
    try:
        with engine.client() as client:
            for code in (1, 2, 3):
                client.call(
                    "cron.add",
                    schedule={
                        "kind": "on_exit",
                        "command": f"sleep {0.3 * code}; echo run {code}; exit {code}",
                    },
                    payload={"kind": "system_event", "text": f"tests done {code}"},
                    name=f"tests-{code}",
                )
        # no client is connected while they run and fire
        assert wait_until(lambda: engine.log().count("event=fired") >= 3, seconds=20)
        first = [
            json.loads(line) for line in engine.cli("events", "--since", "0", "--json").stdout.splitlines()
        ]
    finally:
        assert engine.stop() == 0
    assert [e["job_name"] for e in first] == ["tests-1", "tests-2", "tests-3"]
    assert [e["exit_code"] for e in first] == [1, 2, 3]
    assert [e["stdout_tail"] for e in first] == [f"run {code}\n" for code in (1, 2, 3)]
    assert len({e["fire_id"] for e in first}) == 3
    assert [e["cursor"] for e in first] == sorted(e["cursor"] for e in first)

    again = start_serve(state)
    try:
        after = [
            json.loads(line) for line in again.cli("events", "--since", "0", "--json").stdout.splitlines()
        ]
    finally:
        assert again.stop() == 0
    assert after == first


def test_server_logs_what_the_engine_does(tmp_path: Path) -> None:
    engine = start_serve(tmp_path / "state")
    project = tmp_path / "p"
    project.mkdir()
    with engine.client() as client:
        pid = client.call("subprocess.create", project=str(project), command="sh", args=["-c", "exit 7"])[
            "pid"
        ]
        assert wait_until(lambda: client.call("subprocess.summarize", pid=pid)["exit_code"] == 7)
    assert engine.stop() == 0
    lines = engine.log().splitlines()
    spawned = [line for line in lines if "event=spawned" in line and f"pid={pid}" in line]
    exited = [line for line in lines if "event=exited" in line and f"pid={pid}" in line]
    assert len(spawned) == 1 and "argv=\"sh -c 'exit 7'\"" in spawned[0]
    assert len(exited) == 1 and "exit_code=7" in exited[0] and "reason=exit" in exited[0]
    assert all(line.startswith("ts=") and " level=" in line for line in lines)
