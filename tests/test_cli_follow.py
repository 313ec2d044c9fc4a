"""The CLI's followers (``engine/_cli_follow.py``): ``log -f`` and ``events -f`` against a real engine.

Found by a tester: ``log PID -f | head -1`` on a quiet process printed its line and then hung until the
process ended, and exited 0, not 141: a follower noticed its reader was gone only at its next write.
"""

from __future__ import annotations

import json
import os
import select
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from .serve_support import Served, wait_until

#: A follower whose reader left ends within this, in seconds (the follow pace is 0.25 s; an
#: ``events.wait`` watches standard output while it waits; the rest is the CLI's start-up).
_PROMPT_SECONDS = 5.0

#: ``python -m engine ARGS`` with every request line the client sends to the engine also appended to the
#: file named by the first argument: what the engine is asked, counted on the wire.
_RECORDING = r"""
import socket, sys
from engine._entry import main

record = sys.argv.pop(1)
send = socket.socket.sendall


def sendall(self, data, *args):
    with open(record, "ab") as f:
        f.write(bytes(data))
    return send(self, data, *args)


socket.socket.sendall = sendall
raise SystemExit(main())
"""


def _piped_to_head(served: Served, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run ``gadget-engine ARGS | head -1`` under ``pipefail``: the CLI's exit status is the pipeline's."""
    cli = shlex.join([sys.executable, "-m", "engine", "--state-dir", str(served.state_dir), *args])
    began = time.monotonic()
    piped = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {cli} | head -1"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return piped, time.monotonic() - began


def test_log_follow_exits_141_at_once_when_its_reader_goes_on_a_quiet_log(
    served: Served, project: Path, marker: str
) -> None:
    created = served.cli(
        "create", "--project", str(project), "--", "bash", "-c", f"echo one; exec sleep {marker}"
    )
    assert created.returncode == 0, created.stderr
    pid = created.stdout.strip()
    try:
        assert wait_until(lambda: served.cli("log", pid).stdout == "one\n")
        piped, took = _piped_to_head(served, "log", pid, "-f")
        assert (piped.returncode, piped.stdout, piped.stderr) == (141, "one\n", "")
        assert took < _PROMPT_SECONDS, took
        assert "running" in served.cli("list").stdout  # the quiet process was not what ended the follower
    finally:
        assert served.cli("kill", pid).returncode == 0


def test_events_follow_exits_141_at_once_when_its_reader_goes(served: Served) -> None:
    job = served.cli("cron", "add", "--every", "1h", "--text", "once").stdout.strip()
    try:
        assert served.cli("cron", "run", job).returncode == 0  # one event; none comes after it for an hour
        piped, took = _piped_to_head(served, "events", "-f")
        assert piped.returncode == 141, piped.stderr
        assert piped.stdout.startswith("--- event ") and piped.stdout.count("\n") == 1
        assert took < _PROMPT_SECONDS, took
    finally:
        assert served.cli("cron", "rm", job).returncode == 0


def _asked(record: Path) -> list[str]:
    """The methods of the requests recorded so far (:data:`_RECORDING`), in order."""
    text = record.read_text() if record.exists() else ""
    return [json.loads(line)["method"] for line in text.splitlines()]


def _read_line(proc: subprocess.Popen[bytes], seconds: float) -> bytes:
    """The next line ``proc`` prints on its piped stdout, or what came of it within ``seconds``."""
    assert proc.stdout is not None
    deadline = time.monotonic() + seconds
    line = b""
    while not line.endswith(b"\n") and time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
            chunk = os.read(proc.stdout.fileno(), 1)
            if not chunk:
                break
            line += chunk
    return line


def test_events_follow_idle_asks_the_engine_once_and_still_exits_141_at_once(
    served: Served, tmp_path: Path
) -> None:
    # Found by a reviewer: an idle follower asked events.wait for 1 s at a time (one store query in the
    # engine each second), only so as to look at its reader between two calls.
    listed = served.cli("events", "--json").stdout.splitlines()
    since = str(json.loads(listed[-1])["cursor"]) if listed else "0"
    record = tmp_path / "requests.jsonl"
    argv = ["events", "--state-dir", str(served.state_dir), "--since", since, "-f"]
    follower = subprocess.Popen(
        [sys.executable, "-c", _RECORDING, str(record), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    job = ""
    try:
        assert wait_until(lambda: "events.wait" in _asked(record), 20), _asked(record)
        time.sleep(3.5)  # idle: with 1 s calls, 4 or 5 by now
        assert _asked(record) == ["status", "events", "events.wait"]
        job = served.cli("cron", "add", "--every", "1h", "--text", "woken").stdout.strip()
        began = time.monotonic()
        assert served.cli("cron", "run", job).returncode == 0
        line = _read_line(follower, 10)
        print(f"event printed {time.monotonic() - began:.3f} s after cron run began")
        assert line.startswith(b"--- event ") and b"woken" in line, line  # woken by the event, not its 30 s
        assert _read_line(follower, 10) == b"woken\n"
        assert wait_until(lambda: _asked(record).count("events.wait") == 2, 10), _asked(record)
        assert follower.stdout is not None
        follower.stdout.close()  # the reader goes (| head) while the follower waits in events.wait
        began = time.monotonic()
        status = follower.wait(timeout=20)
        took = time.monotonic() - began
        print(f"exited {status} {took:.3f} s after its reader went")
        assert status == 141 and took < 2.0, (status, took)
        assert follower.stderr is not None and follower.stderr.read() == b""
        assert _asked(record).count("events.wait") == 2
    finally:
        if follower.poll() is None:
            os.killpg(follower.pid, signal.SIGKILL)
            follower.wait()
        if follower.stderr is not None:
            follower.stderr.close()
        if job:
            assert served.cli("cron", "rm", job).returncode == 0
