"""A graceful stop of ``serve`` answers the requests whose work it completes anyway.

Found by a new user: SIGTERM while a ``kill`` waited out its grace period (and a ``wait`` for the same
child) dropped both connections unanswered, though the child was killed. Real ``serve`` processes, real
children ignoring SIGINT, real signals and sockets: the requests waiting for a subprocess are answered
once it has ended (by their own escalation, the stop's, or a second signal's SIGKILL); a new request on
a connection opened before the stop gets an error saying the engine is stopping; a request that waits
for something the stop does not end (``events.wait``) is ended with its connection.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from engine.server._client import EngineClient, EngineStoppingError

from .children import ignoring_sigint, mark
from .serve_support import Served, alive, start_serve, wait_until

#: Generous slack over a stop's own bound (grace + the wait after SIGKILL), in seconds: the machine is shared.
SLACK = 2.5


def _stubborn(served: Served, project: Path, patterns: list[str], seconds: str) -> int:
    """A child that ignores SIGINT (it sits out the whole grace period), ready to be killed."""
    marker = mark(seconds)
    patterns.append(marker)
    out = served.cli("create", "--project", str(project), "--json", "--", *ignoring_sigint(marker))
    assert out.returncode == 0, out.stderr
    pid: int = json.loads(out.stdout)["pid"]
    assert wait_until(lambda: served.cli("log", str(pid)).stdout == "ready\n")
    return pid


def _client_process(served: Served, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "engine", args[0], "--state-dir", str(served.state_dir), *args[1:]],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(procs: list[subprocess.Popen[str]], seconds: float = 30.0) -> list[float]:
    """Wait for every client process; the monotonic time each one ended at (within 20 ms)."""
    ended: dict[int, float] = {}
    deadline = time.monotonic() + seconds
    while len(ended) < len(procs) and time.monotonic() < deadline:
        for i, proc in enumerate(procs):
            if i not in ended and proc.poll() is not None:
                ended[i] = time.monotonic()
        time.sleep(0.02)
    assert len(ended) == len(procs), "a client was not answered"
    return [ended[i] for i in range(len(procs))]


def _status(served: Served, pid: int) -> str:
    with served.client() as client:
        status: str = client.call("subprocess.summarize", pid=pid)["status"]
    return status


def _call(
    pool: concurrent.futures.ThreadPoolExecutor, served: Served, method: str, **params: object
) -> concurrent.futures.Future[tuple[dict[str, Any], float]]:
    """``method`` called from a thread: its answer and the monotonic time it came at.

    From the test process, not a client process: it is in the engine before the stop is asked (a client
    process that connects into the listen backlog just as the stop closes the socket is refused).
    """

    def call() -> tuple[dict[str, Any], float]:
        with EngineClient(str(served.state_dir), timeout_seconds=60) as client:
            result: dict[str, Any] = client.call(method, **params)
        return result, time.monotonic()

    future = pool.submit(call)
    time.sleep(0.3)  # connected and sent (an idle engine reads it at once)
    return future


def _waiting(
    pool: concurrent.futures.ThreadPoolExecutor, served: Served, pid: int
) -> concurrent.futures.Future[tuple[dict[str, Any], float]]:
    """A ``subprocess.wait`` for ``pid`` (see :func:`_call`)."""
    return _call(pool, served, "subprocess.wait", pid=pid, timeout_seconds=60)


def _stopped_cleanly(served: Served) -> None:
    assert served.proc.wait(timeout=20) == 0
    log = served.log()
    assert "event=stopping" in log and "event=stopped" in log, log
    assert not os.path.exists(served.socket_path)


@pytest.mark.serial
@pytest.mark.parametrize(
    ("command", "said"),
    [("kill", "killed {pid}\n"), ("halt", "halted {pid}\n"), ("kill-all", "killed every subprocess\n")],
)
def test_sigterm_answers_a_kill_in_its_grace_and_a_wait_once_the_child_has_ended(
    tmp_path: Path, project: Path, cleanup: list[str], command: str, said: str
) -> None:
    """The new user's input, with a 2 s grace: the kill ends the child by its own escalation (SIGKILL
    2 s after it began), then both calls are answered and ``serve`` exits 0."""
    served = start_serve(tmp_path / "state", "--grace-seconds", "2")
    pid = _stubborn(served, project, cleanup, "6120.5")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = _waiting(pool, served, pid)
        began = time.monotonic()
        killing = _client_process(served, command, *([] if command == "kill-all" else [str(pid)]))
        assert wait_until(lambda: _status(served, pid) == "exiting")  # in its grace period
        stop_at = time.monotonic()
        served.proc.send_signal(signal.SIGTERM)
        (killed_at,) = _finish([killing])
        summary, waited_at = waiting.result(timeout=20)
    out, err = killing.communicate(timeout=5)
    assert (killing.returncode, out) == (0, said.format(pid=pid)), err
    assert (summary["signal"], summary["reason"], summary["finished"]) == (9, "cancelled", True)
    _stopped_cleanly(served)
    print(
        f"{command}: answered {killed_at - began:.3f} s after it began, wait {waited_at - began:.3f} s "
        f"(SIGTERM at {stop_at - began:.3f} s; grace 2 s)"
    )
    assert 2.0 <= killed_at - began < 2.0 + SLACK  # its own escalation, not dropped, not held longer
    assert waited_at - began < 2.0 + SLACK
    assert not alive(pid)


@pytest.mark.serial
def test_sigterm_ends_the_child_a_wait_waits_for_and_answers_it(
    tmp_path: Path, project: Path, cleanup: list[str]
) -> None:
    """No kill: the stop's own escalation ends the child (SIGINT, 1 s, SIGKILL), and the wait says so."""
    served = start_serve(tmp_path / "state", "--grace-seconds", "1")
    pid = _stubborn(served, project, cleanup, "6121.5")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = _waiting(pool, served, pid)
        stop_at = time.monotonic()
        served.proc.send_signal(signal.SIGTERM)
        summary, waited_at = waiting.result(timeout=20)
    assert (summary["signal"], summary["reason"], summary["escalated"]) == (9, "cancelled", True)
    _stopped_cleanly(served)
    print(f"wait answered {waited_at - stop_at:.3f} s after SIGTERM (grace 1 s)")
    assert 1.0 <= waited_at - stop_at < 1.0 + SLACK


@pytest.mark.serial
def test_sigterm_answers_a_create_waiting_for_its_child_to_be_ready(
    tmp_path: Path, project: Path, cleanup: list[str]
) -> None:
    """The stop ends the child a ``create --ready-log`` waits for: the create answers ``ready: exited``."""
    served = start_serve(tmp_path / "state", "--grace-seconds", "1")
    marker = mark("6126.5")
    cleanup.append(marker)
    command, *args = ignoring_sigint(marker)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        creating = _call(
            pool,
            served,
            "subprocess.create",
            project=str(project),
            command=command,
            args=args,
            ready={"log": "never printed", "timeout": 60},
        )
        stop_at = time.monotonic()
        served.proc.send_signal(signal.SIGTERM)
        summary, created_at = creating.result(timeout=20)
    assert (summary["ready"], summary["signal"], summary["reason"]) == ("exited", 9, "cancelled")
    _stopped_cleanly(served)
    print(f"create answered {created_at - stop_at:.3f} s after SIGTERM (grace 1 s)")
    assert 1.0 <= created_at - stop_at < 1.0 + SLACK
    assert not alive(summary["pid"])


@pytest.mark.serial
def test_a_second_signal_forces_the_stop_and_the_kill_and_wait_are_still_answered(
    tmp_path: Path, project: Path, cleanup: list[str]
) -> None:
    served = start_serve(tmp_path / "state", "--grace-seconds", "20")
    pid = _stubborn(served, project, cleanup, "6122.5")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = _waiting(pool, served, pid)
        killing = _client_process(served, "kill", str(pid))
        assert wait_until(lambda: _status(served, pid) == "exiting")  # the kill is in its 20 s grace
        stop_at = time.monotonic()
        served.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        served.proc.send_signal(signal.SIGTERM)  # forces: SIGKILL now
        (killed_at,) = _finish([killing])
        summary, waited_at = waiting.result(timeout=20)
    out, err = killing.communicate(timeout=5)
    assert (killing.returncode, out) == (0, f"killed {pid}\n"), err
    assert (summary["signal"], summary["finished"]) == (9, True)
    _stopped_cleanly(served)
    assert "event=forced signal=SIGTERM" in served.log()
    print(
        f"forced: kill answered {killed_at - stop_at:.3f} s after the first SIGTERM, "
        f"wait {waited_at - stop_at:.3f} s (grace 20 s)"
    )
    assert killed_at - stop_at < 0.5 + SLACK and waited_at - stop_at < 0.5 + SLACK
    assert not alive(pid)


@pytest.mark.serial
def test_engine_stop_during_a_kill_answers_the_stop_and_then_the_kill(
    tmp_path: Path, project: Path, cleanup: list[str]
) -> None:
    served = start_serve(tmp_path / "state", "--grace-seconds", "2")
    pid = _stubborn(served, project, cleanup, "6123.5")
    began = time.monotonic()
    killing = _client_process(served, "kill", str(pid))
    assert wait_until(lambda: _status(served, pid) == "exiting")
    with served.client() as client:
        answer = client.call("engine.stop")
    assert answer == {"pid": served.proc.pid, "stopping": True, "ended_watched": []}
    (killed_at,) = _finish([killing])
    out, err = killing.communicate(timeout=5)
    assert (killing.returncode, out) == (0, f"killed {pid}\n"), err
    _stopped_cleanly(served)
    assert "event=stopping request=engine.stop" in served.log()
    assert 2.0 <= killed_at - began < 2.0 + SLACK
    assert not alive(pid)


def _send(sock: socket.socket, method: str, request_id: int, **params: object) -> None:
    request = {"jsonrpc": "2.0", "method": method, "params": params, "id": request_id}
    sock.sendall(json.dumps(request).encode() + b"\n")


def _read_line(sock: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    return data


@pytest.mark.serial
def test_a_request_on_an_open_connection_after_the_stop_began_gets_the_stopping_error(
    tmp_path: Path, project: Path, cleanup: list[str]
) -> None:
    served = start_serve(tmp_path / "state", "--grace-seconds", "2")
    pid = _stubborn(served, project, cleanup, "6124.5")  # it holds the stop for its grace period
    with (
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock,
        EngineClient(str(served.state_dir), timeout_seconds=10) as client,
    ):
        sock.settimeout(10)
        sock.connect(served.socket_path)
        _send(sock, "status", 1)
        assert json.loads(_read_line(sock))["id"] == 1
        client.call("status")  # its connection is kept for the next call
        stop_at = time.monotonic()
        served.proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: "event=stopping" in served.log())
        _send(sock, "subprocess.halt", 2, pid=pid)
        line = _read_line(sock)
        answered = time.monotonic() - stop_at
        assert line.count(b"\n") == 1
        error = json.loads(line)
        assert error["id"] == 2 and error["error"]["code"] == -32000, error
        assert error["error"]["data"] == {"type": "EngineStoppingError", "pid": served.proc.pid}
        assert error["error"]["message"] == (
            f"the engine on {served.state_dir} (pid {served.proc.pid}) is stopping and takes no new "
            "requests (subprocess.halt was not run); try again once it has stopped"
        )
        _send(sock, "subprocess.list", 3)  # a read is still answered while the stop goes on
        assert [run["pid"] for run in json.loads(_read_line(sock))["result"]] == [pid]
        _send(sock, "status", 4)  # and says the engine is stopping
        assert json.loads(_read_line(sock))["result"]["stopping"] is True
        with pytest.raises(EngineStoppingError, match="is stopping and takes no new requests") as raised:
            client.call("subprocess.kill", pid=pid)
        assert raised.value.pid == served.proc.pid
        print(f"the stopping error came {answered:.3f} s after SIGTERM (the stop takes 2 s)")
        assert answered < 1.5
        assert _read_line(sock) == b""  # closed once the child has ended
    _stopped_cleanly(served)
    assert not alive(pid)


@pytest.mark.serial
def test_an_events_wait_is_ended_with_its_connection_at_the_stop(tmp_path: Path) -> None:
    """It waits for something the stop does not end: its connection closes about a second after the stop
    (the answers under way get up to 1 s), and ``serve`` exits 0."""
    served = start_serve(tmp_path / "state")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(served.socket_path)
        _send(sock, "events.wait", 1, seconds=50)
        time.sleep(0.3)
        stop_at = time.monotonic()
        served.proc.send_signal(signal.SIGTERM)
        assert _read_line(sock) == b""
        closed = time.monotonic() - stop_at
    _stopped_cleanly(served)
    print(f"events.wait closed {closed:.3f} s after SIGTERM")
    assert closed < 1.0 + SLACK


@pytest.mark.serial
def test_a_log_follower_reads_on_through_a_stop_longer_than_5_s(
    tmp_path: Path, project: Path, cleanup: list[str]
) -> None:
    """A follower's reads are still answered during the stop; the stop takes the 6 s grace of a child
    ignoring SIGINT, longer than a follower's 5 s for a broken connection: it ends as after a kill, exit 0."""
    served = start_serve(tmp_path / "state", "--grace-seconds", "6")
    pid = _stubborn(served, project, cleanup, "6125.5")
    follower = _client_process(served, "log", str(pid), "-f")
    assert follower.stdout is not None and follower.stdout.readline() == "ready\n"
    stop_at = time.monotonic()
    served.proc.send_signal(signal.SIGTERM)
    (ended_at,) = _finish([follower])
    _out, err = follower.communicate(timeout=5)
    assert (follower.returncode, err) == (0, ""), err
    _stopped_cleanly(served)
    print(f"log -f ended {ended_at - stop_at:.3f} s after SIGTERM (grace 6 s)")
    assert 6.0 <= ended_at - stop_at < 6.0 + SLACK


@pytest.mark.serial
def test_a_stop_during_a_restart_back_off_restarts_nothing_and_answers_the_wait(
    tmp_path: Path, project: Path, cleanup: list[str]
) -> None:
    """Found by a new user: a record waiting out its restart back-off at the stop was restarted after the
    stop had ended the processes, and a ``wait`` on it was closed unanswered."""
    served = start_serve(tmp_path / "state", "--grace-seconds", "1")
    marker = mark("6131.5")
    cleanup.append(marker)
    # exits 1 at once, every time: restarted after 1 s, 2 s, 4 s ... (on-failure)
    out = served.cli(
        "create", "--project", str(project), "--json", "--restart", "on-failure",
        "--", "sh", "-c", f"echo {marker}; exit 1",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    pid: int = json.loads(out.stdout)["pid"]
    # after its second restart the back-off is 4 s: the stop comes well inside it
    assert wait_until(lambda: _summary(served, pid)["restarts"] >= 2, seconds=20)
    assert wait_until(lambda: "restarting in" in _summary(served, pid)["status"])
    before = _summary(served, pid)["restarts"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = _waiting(pool, served, pid)
        stop_at = time.monotonic()
        served.proc.send_signal(signal.SIGTERM)
        summary, waited_at = waiting.result(timeout=30)
    _stopped_cleanly(served)
    assert waited_at - stop_at < 1.0 + SLACK  # not held for a back-off and a restarted process's grace
    assert summary["finished"] is True and summary["restarts"] == before, summary
    log = served.log()
    assert "event=spawned" not in log[log.index("event=stopping") :], log


def _summary(served: Served, pid: int) -> dict[str, Any]:
    with served.client() as client:
        summary: dict[str, Any] = client.call("subprocess.summarize", pid=pid)
    return summary


@pytest.mark.serial
def test_a_log_follower_prints_what_the_process_writes_as_the_stop_ends_it(
    tmp_path: Path, project: Path, cleanup: list[str]
) -> None:
    """Found by a new user: ``log -f`` stopped reading as the stop began, so the lines a child's SIGINT
    handler wrote while the stop ended it were never printed."""
    served = start_serve(tmp_path / "state", "--grace-seconds", "2")
    marker = mark("6132.5")
    cleanup.append(marker)
    script = (
        f"trap 'echo flushing {marker}; sleep 0.5; echo bye; exit 0' INT; echo ready; "
        "while :; do sleep 0.1; done"
    )
    out = served.cli("create", "--project", str(project), "--json", "--", "bash", "-c", script)
    assert out.returncode == 0, out.stderr
    pid: int = json.loads(out.stdout)["pid"]
    follower = _client_process(served, "log", str(pid), "-f")
    assert follower.stdout is not None and follower.stdout.readline() == "ready\n"
    served.proc.send_signal(signal.SIGTERM)
    _finish([follower])
    printed, err = follower.communicate(timeout=5)
    assert (follower.returncode, err) == (0, ""), err
    assert printed == f"flushing {marker}\nbye\n", printed
    _stopped_cleanly(served)
