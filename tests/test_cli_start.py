"""``gadget-engine start``, ``stop``, ``status``, ``--version`` and ``completion``, with real engines."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import __version__
from engine._cli_start import _running, redact_url
from engine.server._client import (
    EngineClient,
    EngineSocketMissingError,
    EngineStartingError,
    EngineStoppingError,
)
from engine.server._location import lock_holder, lock_state

from .children import kill_pids, mark, pgrep, pgrep_env
from .serve_support import SHELL, alive, cli, wait_until


def _reap(pid: int) -> None:
    """Reap ``pid`` if it became this process's child (a test process that is a subreaper adopts it)."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    """A state dir for engines ``start`` runs; whatever still runs on it at the end is killed."""
    state = tmp_path / "state"
    yield state
    left = pgrep(str(state))
    kill_pids(left)
    for pid in left:
        _reap(pid)


def _ge(state: Path, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return cli("--state-dir", str(state), *args, timeout=timeout)


def _start(state: Path, *extra: str) -> int:
    out = _ge(state, "start", "--grace-seconds", "0.5", *SHELL, *extra, "--json")
    assert out.returncode == 0, out.stderr
    started = json.loads(out.stdout)
    assert started["started"] is True
    return int(started["pid"])


def test_start_returns_once_a_client_call_succeeds_and_stop_leaves_nothing(state_dir: Path) -> None:
    began = time.monotonic()
    out = _ge(state_dir, "start", "--grace-seconds", "0.5", *SHELL)
    took = time.monotonic() - began
    assert out.returncode == 0, out.stderr
    log = state_dir / "engine.log"
    pid = int(out.stdout.split("(pid ")[1].split(")")[0])
    assert out.stdout == f"started the engine on {state_dir} (pid {pid}); its log: {log}\n"
    listed = _ge(state_dir, "list")  # at once: start returned only once the engine answered
    assert listed.returncode == 0, listed.stderr
    assert "event=ready" in log.read_text()

    again = _ge(state_dir, "start", "--grace-seconds", "9")
    assert (again.returncode, again.stdout) == (
        0,
        f"an engine is already running on {state_dir} (pid {pid}); it keeps the options it was started "
        "with (stop it first to change them)\n",
    )
    again_json = _ge(state_dir, "start", "--json")
    assert json.loads(again_json.stdout) == {
        "pid": pid,
        "state_dir": str(state_dir),
        "log": str(log),
        "started": False,
    }  # the keys of a start that started one (found by a new user)

    status = _ge(state_dir, "status")
    assert status.returncode == 0, status.stderr
    fields = {line[:12].strip(): line[13:] for line in status.stdout.splitlines()}
    assert fields["engine"] == f"running, pid {pid}, version {__version__}"
    assert fields["state dir"] == str(state_dir)
    assert fields["socket"] == str(state_dir / "engine.sock")
    assert fields["store"] == f"sqlite:{state_dir / 'cron.sqlite3'}"
    assert fields["runs"] == "none" and fields["last event"] == "none yet"
    as_json = json.loads(_ge(state_dir, "status", "--json").stdout)
    assert as_json["pid"] == pid and as_json["version"] == __version__
    assert as_json["containment"] in ("cgroup", "process-group")
    assert as_json["uptime_seconds"] >= 0 and as_json["last_event"] is None

    stopped = _ge(state_dir, "stop")
    assert (stopped.returncode, stopped.stdout) == (0, f"stopped the engine on {state_dir} (pid {pid})\n")
    _reap(pid)
    assert not alive(pid)
    assert not (state_dir / "engine.sock").exists() and not pgrep(str(state_dir))
    assert "event=stopping request=engine.stop end_watched=false" in log.read_text()
    for command in ("stop", "status"):
        none = _ge(state_dir, command)
        assert none.returncode == 3, none
        assert none.stderr.endswith(f"start one with: gadget-engine --state-dir {state_dir} start\n")
    print(f"start took {took:.2f} s")


def test_start_reports_the_servers_own_error_and_its_log(state_dir: Path) -> None:
    state_dir.mkdir(mode=0o700)
    fd = os.open(state_dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as an engine without a socket would hold it (this process)
        out = _ge(state_dir, "start")
    finally:
        os.close(fd)
    assert out.returncode == 1
    assert out.stderr == (
        f"gadget-engine: the engine did not start: an engine is already running on {state_dir} "
        f"(pid {os.getpid()}) (its log: {state_dir / 'engine.log'})\n"  # /proc/locks names the holder
    )


def test_start_names_an_engine_embedded_in_another_program(state_dir: Path, project: Path) -> None:
    # Found in review: with an `open_engine` in another program holding the state directory, `start` said
    # "an engine is already running ... (pid N)" (exit 1) and nothing of why no client reached it.
    code = (
        "import trio\n"
        "from engine import EngineConfig, open_engine\n"
        "async def main():\n"
        f"    config = EngineConfig(state_dir={str(state_dir)!r}, guardian=False, subreaper=False)\n"
        "    async with open_engine(config):\n"
        "        print('open', flush=True)\n"
        f"        await trio.sleep({mark('889.12')})\n"
        "trio.run(main)\n"
    )
    host = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None and host.stdout.readline() == "open\n"
        assert (state_dir / "lock").read_text() == f"{host.pid} open embedded\n"
        out = _ge(state_dir, "start")
        assert (out.returncode, out.stdout) == (1, "")
        assert out.stderr == (
            f"gadget-engine: an engine embedded in another program is already running on {state_dir} (pid "
            f"{host.pid}); it listens on no socket, so no client reaches it, and no other engine can run "
            "there: stop that program, or use another --state-dir\n"
        )
        assert not (state_dir / "engine.log").exists()  # told before any serve was started
        # serve names it too (what a start says when such a program takes the lock as its serve starts),
        # and so does mcp, which would otherwise forward to it or embed one.
        served = _ge(state_dir, "serve")
        assert served.returncode == 1
        named = f"already running on {state_dir} (pid {host.pid}, embedded in another program)"
        assert named in served.stderr
        mcp = _ge(state_dir, "mcp", "--project", str(project))
        assert mcp.returncode == 1
        assert mcp.stderr.endswith(out.stderr.removeprefix("gadget-engine: ")), mcp.stderr
        assert host.poll() is None and lock_holder(str(state_dir)) == host.pid
    finally:
        host.send_signal(signal.SIGINT)  # the host leaves open_engine: its engine closes
        host.wait(timeout=20)
        assert host.stdout is not None
        host.stdout.close()


def test_start_says_a_servers_start_failure_once(state_dir: Path) -> None:
    """Found by a new user: "the engine did not start: the engine could not start: ..." for a FIFO in the
    state directory."""
    state_dir.mkdir(mode=0o700)
    os.mkfifo(state_dir / "cron.sqlite3")
    out = _ge(state_dir, "start")
    assert out.returncode == 1
    assert out.stderr.startswith("gadget-engine: the engine did not start: "), out.stderr
    assert "could not start" not in out.stderr and "FIFO" in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1


def test_stop_end_watched_ends_watched_commands(state_dir: Path, tmp_path: Path) -> None:
    sleeper = mark("351.1")
    pid = _start(state_dir)
    added = _ge(
        state_dir, "cron", "add", "--on-exit", f"sleep {sleeper}", "--cwd", str(tmp_path), "--text", "x"
    )
    assert added.returncode == 0, added.stderr
    assert wait_until(lambda: bool(pgrep(f"sleep {sleeper}")))
    stopped = _ge(state_dir, "stop", "--end-watched")
    assert stopped.returncode == 0, stopped.stderr
    _reap(pid)
    watched = pgrep(f"sleep {sleeper}")
    kill_pids(watched + pgrep_env("GADGET_WATCH_COMMAND", sleeper))
    assert not watched


def test_stop_past_its_bound_exits_1_and_says_still_stopping(state_dir: Path, project: Path) -> None:
    pid = _start(state_dir, "--grace-seconds", "3")
    ignoring = "import signal,time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)"
    created = _ge(state_dir, "create", "--project", str(project), "--", sys.executable, "-c", ignoring)
    assert created.returncode == 0, created.stderr
    slow = _ge(state_dir, "stop", "--wait-seconds", "0.5")
    assert slow.returncode == 1
    assert f"the engine (pid {pid}) is still stopping after 0.5 s" in slow.stderr
    assert wait_until(lambda: not alive(pid), seconds=20)
    _reap(pid)


def test_start_while_the_engine_stops_waits_for_the_stop_then_starts(state_dir: Path, project: Path) -> None:
    # Found by a new user: `start` during a stop said "the engine did not start: an engine is already
    # running" (exit 1). As systemd queues a start behind a stop, it now waits for the stop to end.
    old = _start(state_dir, "--grace-seconds", "2")
    ignoring = "import signal,time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)"
    created = _ge(state_dir, "create", "--project", str(project), "--", sys.executable, "-c", ignoring)
    assert created.returncode == 0, created.stderr
    slow = _ge(state_dir, "stop", "--wait-seconds", "0.2")  # the stop is under way: the grace is 2 s
    assert slow.returncode == 1 and alive(old)
    too_soon = _ge(state_dir, "start", "--wait-seconds", "0.2")
    assert too_soon.returncode == 1
    assert f"the engine on {state_dir} (pid {old}) is still stopping after 0.2 s" in too_soon.stderr
    started = _ge(state_dir, "start", "--grace-seconds", "0.5", *SHELL, "--json")
    assert started.returncode == 0, started.stderr
    assert f"(pid {old}) is stopping; starting once it has exited" in started.stderr
    new = json.loads(started.stdout)
    assert new["started"] is True and new["pid"] != old and not alive(old)
    _reap(old)
    status = _ge(state_dir, "status", "--json")
    assert json.loads(status.stdout)["pid"] == new["pid"] and json.loads(status.stdout)["stopping"] is False
    assert _ge(state_dir, "stop").returncode == 0
    _reap(new["pid"])


def _crash_leaving_a_child(state_dir: Path, engine: int, project: Path, tag: str) -> None:
    """Create a SIGINT-ignoring child on ``engine``, then SIGKILL the engine and its guardians: the next
    engine's start-up sweep ends the child (SIGINT, its grace period, SIGKILL) before it listens."""
    ignoring = f"import signal,time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)  # {tag}"
    created = _ge(state_dir, "create", "--project", str(project), "--", sys.executable, "-c", ignoring)
    assert created.returncode == 0, created.stderr
    guardians = pgrep(f"_guardian import main.*{state_dir}")
    assert guardians
    kill_pids([engine, *guardians])
    for pid in (engine, *guardians):
        _reap(pid)


def test_start_after_a_crash_returns_once_the_new_engine_answers(state_dir: Path, project: Path) -> None:
    # Found by a new user: after the engine and its guardian were SIGKILLed, `start` said "started" while
    # the new engine was still ending the crashed one's children (it refuses connections meanwhile), and
    # the next `create` said the engine "is stopping and no longer answers".
    tag = mark("889.4")
    _crash_leaving_a_child(state_dir, _start(state_dir, "--grace-seconds", "2"), project, tag)
    new = _start(state_dir, "--grace-seconds", "2")
    assert not pgrep(tag)  # the start-up sweep ended it before the engine answered
    again = _ge(state_dir, "create", "--project", str(project), "--", "sleep", mark("889.5"))
    assert again.returncode == 0, again.stderr  # it answers at once
    assert _ge(state_dir, "stop").returncode == 0
    _reap(new)


@contextlib.contextmanager
def _serve_sweeping(
    state_dir: Path, grace_seconds: float = 4.0, log: Path | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """A ``serve`` with a long grace period, given once it holds the state directory (its start-up sweep
    is then under way: it does not listen until the crashed engine's child is ended; the child ignores
    SIGINT, so the sweep takes the whole grace period); its output to ``log``; killed at the end if it
    still runs, and reaped."""
    argv = [sys.executable, "-m", "engine", "--state-dir", str(state_dir), "serve"]
    argv += ["--grace-seconds", repr(grace_seconds), *SHELL]
    with open(log or os.devnull, "wb") as out:
        serve = subprocess.Popen(argv, stdout=out, stderr=out)
    try:
        assert wait_until(lambda: lock_holder(str(state_dir)) == serve.pid, 20)
        yield serve
    finally:
        if serve.poll() is None:
            serve.kill()
        serve.wait(timeout=10)


def _starting_text(state_dir: Path, pid: int) -> str:
    return (
        f"gadget-engine: the engine on {state_dir} (pid {pid}) is starting and does not answer yet (after a "
        "crash it first ends what the crashed engine left running: up to its grace period, then SIGKILL); "
        "try again once it answers (gadget-engine start waits for it)\n"
    )


def test_clients_say_an_engine_that_ends_a_crashed_ones_children_is_starting(
    state_dir: Path, project: Path
) -> None:
    # Found by a new user: while a new engine ended what a crashed one had left (its start-up sweep, before
    # it listens), every client said it "is stopping and no longer answers", a second `start` waited for a
    # stop that never came and failed, and `stop` waited for an exit that never came.
    first = mark("889.6")
    _crash_leaving_a_child(state_dir, _start(state_dir), project, first)
    second = mark("889.7")
    with _serve_sweeping(state_dir) as serve:
        listed = _ge(state_dir, "list")
        assert listed.returncode == 1
        assert listed.stderr == _starting_text(state_dir, serve.pid)
        (state_dir / "engine.sock").unlink()  # its phase, in the lock file, says it all the same
        listed = _ge(state_dir, "list")
        assert (listed.returncode, listed.stderr) == (1, _starting_text(state_dir, serve.pid))
        again = _ge(state_dir, "start", "--json")  # waits for it to answer, then says it runs
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout)["pid"] == serve.pid
        assert json.loads(again.stdout)["started"] is False
        assert f"(pid {serve.pid}) is starting" in again.stderr
        assert not pgrep(first)  # it answered only once the sweep had ended the crashed engine's child
        _crash_leaving_a_child(state_dir, serve.pid, project, second)

    log = state_dir.parent / "sweeping.log"
    with _serve_sweeping(state_dir, log=log) as serve:
        stopped = _ge(state_dir, "stop")  # asks it to stop: it closes once the sweep is over, unserved
        assert stopped.returncode == 0, stopped.stderr
        assert stopped.stdout == f"stopped the engine on {state_dir} (pid {serve.pid})\n"
        assert f"(pid {serve.pid}) is starting" in stopped.stderr
        assert "asked it to stop: it closes once that is over, without answering" in stopped.stderr
        assert serve.wait(timeout=10) == 0
        assert not pgrep(second)
    lines = [line for line in log.read_text().splitlines() if " event=" in line]
    events = [line.split(" event=")[1].split()[0] for line in lines]
    assert "ready" not in events  # it never listened
    assert events[:2] == ["sweeping", "stopping"]  # logged as the sweep began, and at the signal
    assert " processes=1 " in lines[0]  # the crashed engine's one child (counted once, not per way found)
    assert "swept" in events
    assert events[-1] == "stopped"


def test_a_second_signal_during_the_start_up_sweep_ends_its_grace_period(
    state_dir: Path, project: Path
) -> None:
    # Found by a new user: SIGTERM to an engine in its start-up sweep was held until the sweep had run its
    # whole grace period; a second one changed nothing, and the engine then logged `ready` before stopping.
    child = mark("889.8")
    _crash_leaving_a_child(state_dir, _start(state_dir), project, child)
    log = state_dir.parent / "forced.log"
    with _serve_sweeping(state_dir, grace_seconds=120.0, log=log) as serve:
        assert wait_until(lambda: "event=sweeping" in log.read_text(), 20)
        serve.send_signal(signal.SIGSTOP)  # stopped in its sweep: named so, not "starting"
        try:
            listed = _ge(state_dir, "list")
            assert (listed.returncode, listed.stderr) == (
                1,
                f"gadget-engine: the engine on {state_dir} (pid {serve.pid}) is stopped (SIGSTOP, or Ctrl-Z "
                f"in its terminal) and answers nothing until it is continued: kill -CONT {serve.pid}\n",
            )
        finally:
            serve.send_signal(signal.SIGCONT)
        serve.send_signal(signal.SIGTERM)
        assert wait_until(lambda: "event=stopping" in log.read_text(), 20)
        assert pgrep(child)  # the sweep's grace period runs on: the child ignores SIGINT
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0  # not the 120 s grace period: SIGKILL at the second signal
        assert not pgrep(child)
    text = log.read_text()
    assert "event=forced" in text
    assert "event=ready" not in text


def test_a_start_queued_behind_a_stop_of_a_starting_engine_starts_a_new_one(
    state_dir: Path, project: Path
) -> None:
    # Found by a new user: with `start` and `stop` both waiting on an engine in its start-up sweep, `start`
    # read "running" in the instant between the engine's `ready` and the stop, said "already running"
    # (exit 0), and the engine was stopped right after: none ran.
    child = mark("889.9")
    _crash_leaving_a_child(state_dir, _start(state_dir), project, child)
    said = state_dir.parent / "start.err"
    with _serve_sweeping(state_dir, grace_seconds=3.0) as serve, open(said, "w") as err_file:
        argv = [sys.executable, "-m", "engine", "--state-dir", str(state_dir), "start", "--json"]
        starting = subprocess.Popen(
            [*argv, "--grace-seconds", "0.5", *SHELL], stdout=subprocess.PIPE, stderr=err_file, text=True
        )
        try:
            assert wait_until(lambda: "is starting" in said.read_text(), 20)  # the start waits on it
            stopped = _ge(state_dir, "stop")
            assert stopped.returncode == 0, stopped.stderr
            out, _ = starting.communicate(timeout=60)
        finally:
            if starting.poll() is None:
                starting.kill()
                starting.wait()
        assert serve.wait(timeout=10) == 0
    err = said.read_text()
    assert starting.returncode == 0, err
    started = json.loads(out)
    assert started["started"] is True  # a new engine: not the one the stop ended
    assert started["pid"] != serve.pid
    assert alive(started["pid"])
    assert _ge(state_dir, "status").returncode == 0
    assert _ge(state_dir, "stop").returncode == 0
    _reap(started["pid"])


def test_a_start_whose_engine_is_stopped_in_its_sweep_says_so(state_dir: Path, project: Path) -> None:
    # Found by a new user: a `start` whose own engine was stopped during its start-up sweep said "the engine
    # did not start: ts=... event=stopped ...", the last line of the engine's log.
    child = mark("889.10")
    _crash_leaving_a_child(state_dir, _start(state_dir), project, child)
    argv = [sys.executable, "-m", "engine", "--state-dir", str(state_dir), "start", "--grace-seconds", "3"]
    starting = subprocess.Popen([*argv, *SHELL], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_until(lambda: "event=sweeping" in (state_dir / "engine.log").read_text(), 20)
        stopped = _ge(state_dir, "stop")
        assert stopped.returncode == 0, stopped.stderr
        _, err = starting.communicate(timeout=60)
    finally:
        if starting.poll() is None:
            starting.kill()
            starting.wait()
    assert starting.returncode == 1
    pid = lock_state(str(state_dir))
    assert pid is not None and pid.holder is None  # no engine
    assert err.startswith("gadget-engine: the engine (pid ")
    assert err.endswith(
        f"was stopped before it answered (a stop or a signal during its start-up sweep); its log: "
        f"{state_dir / 'engine.log'}\n"
    )
    assert not pgrep(child)


def test_a_stopped_engine_is_named_not_waited_for_forever(state_dir: Path, project: Path) -> None:
    # Found by a new user: with the engine stopped (SIGSTOP, Ctrl-Z in its terminal), `list`, `status` and
    # `stop --wait-seconds 3` waited for its answer forever.
    pid = _start(state_dir)
    os.kill(pid, signal.SIGSTOP)
    try:
        said = (
            f"gadget-engine: the engine on {state_dir} (pid {pid}) is stopped (SIGSTOP, or Ctrl-Z in its "
            f"terminal) and answers nothing until it is continued: kill -CONT {pid} (the request was sent: "
            "the engine runs it then)\n"
        )
        for args in (("list",), ("stop", "--wait-seconds", "3")):
            out = _ge(state_dir, *args, timeout=30)
            assert (out.returncode, out.stderr) == (1, said)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert _ge(state_dir, "list").returncode == 0  # continued, it answers as before
    assert _ge(state_dir, "stop").returncode == 0
    _reap(pid)


def test_stop_signals_only_a_serve_that_wrote_its_own_lock_line(state_dir: Path) -> None:
    # Found by a new user: a process that merely held the lock (`flock lock sleep`) after a crash, with the
    # crashed engine's socket file left, was told "the engine ... is starting", and `stop` sent it SIGTERM
    # and said "stopped the engine".
    state_dir.mkdir(mode=0o700)
    (state_dir / "lock").write_text("1 serving serve\n")  # the crashed engine's line
    (state_dir / "lock").chmod(0o600)
    with socket.socket(socket.AF_UNIX) as leftover:
        leftover.bind(str(state_dir / "engine.sock"))  # closed unlistened: a connect is refused
    nap = mark("889.11")
    holder = subprocess.Popen(["flock", str(state_dir / "lock"), "sleep", nap])
    try:
        assert wait_until(lambda: lock_holder(str(state_dir)) == holder.pid, 10)
        out = _ge(state_dir, "stop", "--wait-seconds", "1")
        assert out.returncode == 1
        assert "asked it to stop" not in out.stderr
        assert "is still starting and does not answer after 1 s" in out.stderr
        assert holder.poll() is None and pgrep(f"^sleep {nap}$")  # not signalled
    finally:
        holder.kill()
        holder.wait()
        kill_pids(pgrep(f"^sleep {nap}$"))


def test_a_refused_socket_is_told_starting_or_stopping_by_the_lock(tmp_path: Path) -> None:
    """A real lock (this process holds it, as an engine does) and a real socket file nobody listens on,
    or none: the client says "starting" for an engine that has not written its pid yet, whose lock says
    ``starting``, or (an earlier version's pid alone, or ``open``) whose refusing socket file is older
    than its lock; "stopping" for one whose lock says so, or whose own socket stopped listening; and an
    engine that serves but lost its socket file binds it again."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    sock_path, lock = state / "engine.sock", state / "lock"
    lock.write_text("1\n")  # an earlier engine's pid
    lock.chmod(0o600)
    fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def refused_socket() -> None:
        sock_path.unlink(missing_ok=True)
        with socket.socket(socket.AF_UNIX) as bound:
            bound.bind(str(sock_path))  # closed unlistened: a connect is refused

    def refused() -> Exception:
        with pytest.raises(EngineSocketMissingError) as info:
            EngineClient(str(state)).connect()
        assert info.value.pid == os.getpid()
        return info.value

    def write(phase: str = "") -> None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {phase}".strip().encode() + b"\n", 0)

    try:
        refused_socket()
        assert isinstance(refused(), EngineStartingError)  # the lock is taken, the pid not written yet
        for phase in ("", "open"):  # an earlier version's line, and an open engine about to bind
            write(phase)
            time.sleep(0.05)  # past the coarse clock's tick
            refused_socket()
            assert type(refused()) is EngineStoppingError  # its own socket, made after its lock: a stop
            time.sleep(0.05)
            write(phase)
            assert isinstance(refused(), EngineStartingError)  # a socket file older than the lock: a leftover
        write("starting")
        assert isinstance(refused(), EngineStartingError)
        sock_path.unlink()
        assert isinstance(refused(), EngineStartingError)  # its phase, with no socket file at all
        write("stopping")
        assert type(refused()) is EngineStoppingError
        write("open embedded")  # an engine embedded in another program never listens: it says so
        assert type(refused()) is EngineSocketMissingError
        assert "embedded in another program" in str(refused())
        write("serving")
        assert type(refused()) is EngineSocketMissingError  # it binds it again
        # `start` waits for that (it spawned a serve that failed "already running"), not for an engine
        # that never listens (embedded: `open`), where its serve's error says at once who holds the lock.
        assert _running(str(state)) == {"pid": os.getpid(), "starting": True, "rebinding": True}
        write("open")
        assert _running(str(state)) is None
    finally:
        os.close(fd)


def test_a_cron_run_cut_by_a_stop_says_the_engine_is_stopping(state_dir: Path) -> None:
    # Found by a new user: it said "it is stopping, or it refuses clients of another user" (no other user
    # was involved); the other-user clause is now only said when the engine runs as another uid.
    slow = mark("7711.5")
    pid = _start(state_dir)
    job = _ge(state_dir, "cron", "add", "--every", "1h", "--name", "slow", "--command", "sleep", slow)
    assert job.returncode == 0, job.stderr
    run = subprocess.Popen(
        [sys.executable, "-m", "engine", "cron", "run", "--state-dir", str(state_dir), job.stdout.strip()],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert wait_until(lambda: bool(pgrep(f"sleep {slow}")))
    assert _ge(state_dir, "stop").returncode == 0
    _reap(pid)
    out, err = run.communicate(timeout=20)
    assert (run.returncode, out) == (1, "")
    assert err.startswith(f"gadget-engine: the engine on {state_dir} ")
    assert "before answering (cron.run_now)" in err and "another user" not in err and err.count("\n") == 1
    assert not pgrep(f"sleep {slow}")


def test_two_stops_at_once_both_wait_for_the_exit(state_dir: Path, project: Path) -> None:
    # Found by a new user: the second `stop` said "try again once it has stopped" (exit 1), and trying
    # again then said no engine runs (exit 3). Both now wait for the one stop and exit 0.
    pid = _start(state_dir, "--grace-seconds", "1")
    ignoring = "import signal,time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)"
    created = _ge(state_dir, "create", "--project", str(project), "--", sys.executable, "-c", ignoring)
    assert created.returncode == 0, created.stderr
    first = subprocess.Popen(
        [sys.executable, "-m", "engine", "stop", "--state-dir", str(state_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert wait_until(lambda: "event=stopping" in (state_dir / "engine.log").read_text())
    second = _ge(state_dir, "stop", "--end-watched")
    out, err = first.communicate(timeout=20)
    assert (first.returncode, err) == (0, "") and out == f"stopped the engine on {state_dir} (pid {pid})\n"
    assert second.returncode == 0 and second.stdout == out
    assert second.stderr == (
        f"gadget-engine: the engine (pid {pid}) was already stopping; --end-watched is that stop's to apply "
        "(without it, watched on-exit commands are left running for the next engine)\n"
    )
    assert not alive(pid)
    _reap(pid)


def test_a_ctrl_c_during_kill_says_the_engine_goes_on(state_dir: Path, project: Path) -> None:
    # Found by a new user: a Ctrl-C during `kill` exited 130 saying nothing, while the kill went on.
    _start(state_dir, "--grace-seconds", "3")
    ignoring = "import signal,time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)"
    created = _ge(state_dir, "create", "--project", str(project), "--", sys.executable, "-c", ignoring)
    pid = created.stdout.strip()
    killing = subprocess.Popen(
        [sys.executable, "-m", "engine", "kill", "--state-dir", str(state_dir), pid],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def exiting() -> bool:
        listed = json.loads(_ge(state_dir, "list", "--json").stdout.splitlines()[0])
        return bool(listed["state"] == "exiting")

    assert wait_until(exiting)  # the kill is in its 3 s grace
    killing.send_signal(signal.SIGINT)
    out, err = killing.communicate(timeout=10)
    assert (killing.returncode, out) == (130, "")
    assert err == (
        "gadget-engine: interrupted; the engine goes on ending the process and deletes its logs "
        "(gadget-engine list shows it)\n"
    )
    assert wait_until(lambda: _ge(state_dir, "list", "--json").stdout == "", seconds=10)  # it went on
    assert _ge(state_dir, "stop").returncode == 0


def test_version_prints_the_version() -> None:
    out = cli("--version")
    assert (out.returncode, out.stdout) == (0, f"gadget-engine {__version__}\n")


def test_status_redacts_a_store_urls_password() -> None:
    assert redact_url("postgresql://me:s3cret@db:5432/jobs") == "postgresql://me:***@db:5432/jobs"
    assert redact_url("sqlite:/home/me/state/cron.sqlite3") == "sqlite:/home/me/state/cron.sqlite3"
    assert redact_url("postgresql://db/jobs") == "postgresql://db/jobs"


# ---- completion ------------------------------------------------------------------------------------


def _complete(script: Path, *words: str, cwd: Path | None = None) -> list[str]:
    """What a real bash completes for ``words`` (the last one being typed) with ``script`` loaded."""
    line = " ".join(words)
    program = f"""
source {script}
fn=$(complete -p gadget-engine | sed -E 's/.* -F ([^ ]+) .*/\\1/')
COMP_WORDS=({" ".join(repr(w) for w in words)})
COMP_CWORD={len(words) - 1}
COMP_LINE={line!r}
COMP_POINT=${{#COMP_LINE}}
"$fn" gadget-engine {words[-1]!r} {words[-2]!r}
printf '%s\\n' "${{COMPREPLY[@]}}"
"""
    out = subprocess.run(
        ["bash", "-c", program], capture_output=True, text=True, timeout=30, check=True, cwd=cwd
    )
    return [word.strip() for word in out.stdout.splitlines() if word.strip()]


def test_completion_in_a_real_bash(tmp_path: Path) -> None:
    script = tmp_path / "gadget-engine.bash"
    out = cli("completion", "bash")
    assert out.returncode == 0, out.stderr
    script.write_text(out.stdout)
    assert sorted(_complete(script, "gadget-engine", "cr")) == ["create", "cron"]
    assert _complete(script, "gadget-engine", "cro") == ["cron"]
    assert sorted(_complete(script, "gadget-engine", "st")) == ["start", "status", "stop"]
    assert sorted(_complete(script, "gadget-engine", "cron", "r")) == ["rm", "run"]
    assert "--end-watched" in _complete(script, "gadget-engine", "stop", "--")
    (tmp_path / "somedir").mkdir()
    (tmp_path / "somefile").touch()
    assert _complete(script, "gadget-engine", "create", "--project", "so", cwd=tmp_path) == [
        "somedir"
    ]  # no file


@pytest.mark.parametrize("shell", ["zsh", "fish"])
def test_completion_scripts_for_zsh_and_fish(shell: str) -> None:
    out = cli("completion", shell)
    assert out.returncode == 0, out.stderr
    assert "gadget-engine" in out.stdout and "cron" in out.stdout and "end-watched" in out.stdout
    if shutil.which(shell):
        checked = subprocess.run([shell, "-n"], input=out.stdout, capture_output=True, text=True, timeout=30)
        assert checked.returncode == 0, checked.stderr


def test_completion_of_an_unknown_shell_is_a_usage_error() -> None:
    assert cli("completion", "tcsh").returncode == 2


def test_start_never_writes_through_a_link_planted_as_its_log(tmp_path: Path) -> None:
    """Found by a new user: with ``<state_dir>/engine.log`` a link elsewhere, ``start`` wrote there."""
    state, target = tmp_path / "state", tmp_path / "elsewhere.log"
    state.mkdir(mode=0o700)
    target.write_text("")
    (state / "engine.log").symlink_to(target)
    out = cli("--state-dir", str(state), "start")
    assert out.returncode == 1, out
    assert "is a symbolic link, which the engine does not follow; remove it" in out.stderr
    assert target.read_text() == "" and not (state / "engine.sock").exists()


def test_start_status_stop_on_a_state_dir_too_deep_for_its_own_socket(tmp_path: Path) -> None:
    """Found by a new user: ``start`` said ``AF_UNIX path too long`` where ``serve`` binds elsewhere."""
    state = tmp_path / ("d" * (110 - len(str(tmp_path))))
    assert len(str(state / "engine.sock")) > 107
    none = cli("--state-dir", str(state), "status")
    assert none.returncode == 3 and "no engine is running" in none.stderr, none
    started = cli("--state-dir", str(state), "start", "--grace-seconds", "0.5")
    try:
        assert started.returncode == 0, started
        assert cli("--state-dir", str(state), "status").returncode == 0
    finally:
        stopped = cli("--state-dir", str(state), "stop")
    assert stopped.returncode == 0, stopped
