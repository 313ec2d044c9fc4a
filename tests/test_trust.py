"""The state directory is trusted only if it is ours (``engine/_trust.py``): issue 16's "tried" cases.

The foreign-owner cases need a second uid: they run as root and hand files (and a listener, a sleeper)
to ``nobody`` (65534) with ``chown`` and ``setpriv``; elsewhere they are skipped with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from engine import EngineConfig, OnExit, SystemEvent, UntrustedPathError, open_engine
from engine._procfs import read_proc
from engine._sweep import GroupRecord
from engine._trust import check_state_dir, describe_problem, make_state_dir, read_pointer
from engine.cron._store import SqliteJobStore

from .children import add_session_root, kill_leftovers, mark, pgrep
from .serve_support import cli, start_serve

NOBODY = 65534
ROOT_ONLY = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to act as a second uid (nobody, 65534)",
)


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A folder under /tmp that ``nobody`` may traverse (0711), unique to this test and session."""
    path = Path(tempfile.mkdtemp(prefix="gadget-trust-", dir="/tmp"))
    path.chmod(0o711)
    add_session_root(path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def chown_tree(path: Path, uid: int) -> None:
    for root, dirs, files in os.walk(path):
        for name in (*dirs, *files):
            os.lchown(os.path.join(root, name), uid, uid)
    os.chown(path, uid, uid)


def as_nobody(*argv: str) -> list[str]:
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]


def config(state: Path) -> EngineConfig:
    return EngineConfig(
        state_dir=str(state),
        grace_seconds=0.3,
        kill_wait_seconds=2.0,
        guardian=False,
        exit_watch_shell=("bash", "-c", "--"),  # no login profile: not the point here
    )


# ---- the rules ------------------------------------------------------------------------------------------


def test_describe_problem_names_link_kind_owner_and_mode(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    os.symlink(tmp_path / "f", tmp_path / "link")
    os.mkfifo(tmp_path / "fifo")
    assert describe_problem(os.lstat(tmp_path / "f"), "file") is None
    assert "symbolic link" in (describe_problem(os.lstat(tmp_path / "link"), "file") or "")
    assert describe_problem(os.lstat(tmp_path / "fifo"), "file") == "is a FIFO, not a regular file"
    assert describe_problem(os.lstat(tmp_path / "f"), "directory") == "is a regular file, not a directory"
    (tmp_path / "f").chmod(0o664)
    assert describe_problem(os.lstat(tmp_path / "f"), "file") == "is writable by group (mode 0664)"
    (tmp_path / "f").chmod(0o646)
    assert describe_problem(os.lstat(tmp_path / "f"), "file") == "is writable by others (mode 0646)"


def test_state_dir_is_made_0700_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        make_state_dir(str(tmp_path / "a" / "state"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "a" / "state").st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o775, 0o757, 0o777, 0o1777])
async def test_state_dir_writable_by_others_is_refused_with_the_fix(tmp_path: Path, mode: int) -> None:
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(mode)
    with pytest.raises(UntrustedPathError, match=r"is writable by .*chmod 700 .*another --state-dir"):
        async with open_engine(config(state)):
            pass
    assert sorted(os.listdir(state)) == []  # refused before anything was made in it
    state.chmod(0o755)  # not writable by others: fine as it is
    async with open_engine(config(state)):
        pass


@pytest.mark.parametrize(
    ("name", "make"),
    [
        ("lock", lambda p, t: os.symlink(t, p)),
        ("groups", lambda p, t: os.symlink(t.parent, p)),
        ("engine.sock.path", lambda p, t: os.symlink(t, p)),
        ("guardian.log", lambda p, t: os.mkfifo(p)),
        ("engine.sock", lambda p, t: p.write_text("not a socket")),
        # A FIFO blocked the open of these, and the start with it (found by a new user)
        ("lock", lambda p, t: os.mkfifo(p)),
        ("engine-id", lambda p, t: os.mkfifo(p)),
        ("engine-id", lambda p, t: os.symlink(t, p)),
        ("lock", lambda p, t: os.mkdir(p)),  # said "[Errno 21] Is a directory" (found by a new user)
    ],
)
async def test_entries_of_the_state_dir_are_checked_before_use(
    tmp_path: Path, name: str, make: object
) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    target = tmp_path / "outside.txt"
    target.write_text("outside")
    target.chmod(0o644)
    assert callable(make)
    make(state / name, target)
    with trio.fail_after(10), pytest.raises(UntrustedPathError, match=str(state / name)):
        async with open_engine(config(state)):
            pass
    assert target.read_text() == "outside" and stat.S_IMODE(target.stat().st_mode) == 0o644
    status = subprocess.run(  # a client looks at the lock too: a FIFO there never blocks it
        [sys.executable, "-m", "engine", "--state-dir", str(state), "status"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert status.returncode in (1, 3) and "Traceback" not in status.stderr, status.stderr


async def test_store_linked_elsewhere_is_refused_and_the_target_keeps_its_mode(tmp_path: Path) -> None:
    """Tried: a ``cron.sqlite3`` linked to ``/dev/null`` made the engine chmod it 0600 (here: a file)."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    target = tmp_path / "shared.db"
    target.write_bytes(b"")
    target.chmod(0o666)
    os.symlink(target, state / "cron.sqlite3")
    with pytest.raises(UntrustedPathError, match=r"cron\.sqlite3.* symbolic link"):
        async with open_engine(config(state)):
            pass
    store = SqliteJobStore(str(state / "cron.sqlite3"))  # the store checks on its own too
    with pytest.raises(UntrustedPathError, match="symbolic link"):
        await store.open()
    os.unlink(state / "cron.sqlite3")
    os.symlink(target, state / "cron.sqlite3-wal")
    with pytest.raises(UntrustedPathError, match=r"cron\.sqlite3-wal"):
        await store.open()
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 and target.read_bytes() == b""


def test_read_pointer_believes_only_our_own_file(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    assert read_pointer(str(state), "engine.sock.path") is None
    (state / "engine.sock.path").write_text("/run/x.sock\n")
    assert read_pointer(str(state), "engine.sock.path") == "/run/x.sock"
    (state / "engine.sock.path").chmod(0o666)
    with pytest.raises(UntrustedPathError, match="writable by group and others"):
        read_pointer(str(state), "engine.sock.path")
    os.unlink(state / "engine.sock.path")
    os.symlink(tmp_path / "elsewhere", state / "engine.sock.path")
    with pytest.raises(UntrustedPathError, match="symbolic link"):
        read_pointer(str(state), "engine.sock.path")
    assert read_pointer(str(tmp_path / "missing"), "engine.sock.path") is None


# ---- a second uid ---------------------------------------------------------------------------------------


async def _plant_on_exit_job(state: Path, ran: Path) -> None:
    """A job of the store that runs ``touch RAN`` as soon as an engine starts (enabled on-exit)."""
    async with open_engine(config(state)) as engine:
        job = await engine.cron.add(
            OnExit(command=f"touch {ran}", cwd=str(ran.parent)), SystemEvent("planted"), enabled=False
        )
    conn = sqlite3.connect(state / "cron.sqlite3")
    data = json.loads(conn.execute("SELECT data FROM jobs WHERE id = ?", (job.id,)).fetchone()[0])
    data["enabled"] = True
    conn.execute("UPDATE jobs SET data = ? WHERE id = ?", (json.dumps(data), job.id))
    conn.commit()
    conn.close()


@ROOT_ONLY
async def test_root_engine_refuses_a_state_dir_of_another_user_and_never_runs_its_job(
    tmp_path: Path,
) -> None:
    """Tried: a root ``serve`` on a state dir owned by another user ran a job that user had planted."""
    state = tmp_path / "state"
    ran = tmp_path / "ran"
    await _plant_on_exit_job(state, ran)
    chown_tree(state, NOBODY)
    with pytest.raises(
        UntrustedPathError,
        match=(
            r"owned by uid 65534, not by this engine's uid 0; "
            r"use another --state-dir, or run the engine as the folder's owner"
        ),
    ):
        async with open_engine(config(state)):
            pass
    result = await trio.to_thread.run_sync(lambda: cli("--state-dir", str(state), "serve", timeout=20))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "owned by uid 65534" in result.stderr.splitlines()[-1]
    await trio.sleep(0.5)
    assert not ran.exists()
    chown_tree(state, 0)  # the same state dir, ours again: the planted job does run (the test is real)
    async with open_engine(config(state)):
        with trio.fail_after(10):
            while not ran.exists():
                await trio.sleep(0.02)


@ROOT_ONLY
async def test_root_sweep_never_signals_what_a_planted_group_record_names(tmp_path: Path) -> None:
    """Tried: a planted group record made the start-up sweep signal a process of that user's choosing."""
    marker = mark("340.61")
    victim = subprocess.Popen(as_nobody("sleep", marker), start_new_session=True)
    try:
        info = None
        with trio.fail_after(5):
            while info is None or info.sid != victim.pid:
                await trio.sleep(0.01)
                info = read_proc(victim.pid)
        record = GroupRecord(victim.pid, victim.pid, info.start_time, "planted:1")
        for owner in (NOBODY, 0):  # a state dir of theirs; then ours with their file in groups/
            state = tmp_path / f"state-{owner}"
            (state / "groups").mkdir(parents=True, mode=0o700)
            record.write(str(state))
            chown_tree(state, owner)
            os.lchown(record.path(str(state)), NOBODY, NOBODY)
            with pytest.raises(UntrustedPathError, match="65534"):
                async with open_engine(config(state)):
                    pass
            await trio.sleep(0.3)
            assert victim.poll() is None and pgrep(f"sleep {marker}") == [victim.pid]
        os.lchown(record.path(str(state)), 0, 0)  # ours: the sweep ends what the record names
        async with open_engine(config(state)):
            pass
        assert victim.wait(timeout=5) is not None
    finally:
        kill_leftovers(f"sleep {marker}")
        victim.wait(timeout=5)


_LISTENER = """
import socket, sys
path, out = sys.argv[1], sys.argv[2]
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(path); srv.listen(4)
print("listening", flush=True)
got = b""
srv.settimeout(8)
try:
    while True:
        conn, _ = srv.accept()
        conn.settimeout(2)
        try:
            while True:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                got += chunk
        except OSError:
            pass
        conn.close()
except OSError:
    pass
open(out, "wb").write(got)
"""


@ROOT_ONLY
def test_root_cli_never_sends_to_a_socket_a_planted_pointer_names(open_tmp: Path, tmp_path: Path) -> None:
    """Tried: a planted ``engine.sock.path`` made the root CLI send ``-e API_TOKEN=...`` to that socket."""
    theirs = open_tmp / "theirs"
    theirs.mkdir(mode=0o700)
    chown_tree(theirs, NOBODY)
    sock_path, received = theirs / "trap.sock", theirs / "received"
    listener = subprocess.Popen(
        as_nobody(sys.executable, "-c", _LISTENER, str(sock_path), str(received)),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert listener.stdout is not None and listener.stdout.readline().strip() == "listening"
        project = tmp_path / "app"
        project.mkdir()
        their_state = open_tmp / "state"  # a state dir of theirs, pointing at their socket
        their_state.mkdir(mode=0o700)
        (their_state / "engine.sock.path").write_text(f"{sock_path}\n")
        chown_tree(their_state, NOBODY)
        our_state = tmp_path / "state"  # our own state dir, whose pointer names their socket
        our_state.mkdir(mode=0o700)
        (our_state / "engine.sock.path").write_text(f"{sock_path}\n")
        for state, expected in ((their_state, "owned by uid 65534"), (our_state, "of uid 65534")):
            result = cli(
                "create", "--state-dir", str(state), "--project", str(project),
                "-e", "API_TOKEN=s3cret", "--", "true",
            )  # fmt: skip
            assert result.returncode == 1, result
            assert expected in result.stderr and "Traceback" not in result.stderr
        listener.wait(timeout=20)
        assert b"s3cret" not in received.read_bytes() and received.read_bytes() == b""
    finally:
        listener.kill()
        listener.communicate(timeout=5)


@ROOT_ONLY
def test_socket_of_another_user_is_refused_by_the_client_before_it_sends(open_tmp: Path) -> None:
    """The client's own check, whatever the pointer: the peer's uid (``SO_PEERCRED``)."""
    from engine.server._client import EngineClient

    theirs = open_tmp / "theirs"
    theirs.mkdir(mode=0o755)
    chown_tree(theirs, NOBODY)
    path = theirs / "engine.sock"
    code = (
        "import socket,sys,time\n"
        "s=socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(1); print('up', flush=True)\n"
        "c,_=s.accept(); c.settimeout(3)\n"
        "try:\n    d=c.recv(10)\nexcept OSError:\n    d=b''\n"
        "print('got', len(d), flush=True)\n"
    )
    listener = subprocess.Popen(
        as_nobody(sys.executable, "-c", code, str(path)), stdout=subprocess.PIPE, text=True
    )
    try:
        assert listener.stdout is not None and listener.stdout.readline().strip() == "up"
        state = open_tmp / "ours"
        state.mkdir(mode=0o700)
        (state / "engine.sock.path").write_text(str(path))
        with pytest.raises(UntrustedPathError, match="uid 65534"), EngineClient(str(state)) as client:
            client.call("status")
        out, _ = listener.communicate(timeout=10)
        assert out.strip() == "got 0"
    finally:
        listener.kill()
        listener.communicate(timeout=5)


def test_serve_refuses_a_state_dir_writable_by_others_in_one_line(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(0o777)
    started = time.monotonic()
    result = cli("--state-dir", str(state), "serve", timeout=20)
    assert result.returncode == 1 and time.monotonic() - started < 15
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("gadget-engine: the engine could not start: the state directory")
    assert "writable by group and others (mode 0777)" in last and "chmod 700" in last
    assert "Traceback" not in result.stderr
    check_state_dir_is_untouched = sorted(os.listdir(state))
    assert check_state_dir_is_untouched == []


def test_check_state_dir_passes_a_running_engines_own_dir(tmp_path: Path) -> None:
    served = start_serve(tmp_path / "state")
    try:
        served.cli("list")
        check_state_dir(str(served.state_dir))  # everything a running engine made is ours
    finally:
        assert served.stop() == 0
