"""The CLI's followers (``engine/_cli_follow.py``): ``log -f`` and ``events -f`` against a real engine.

Found by a tester: ``log PID -f | head -1`` on a quiet process printed its line and then hung until the
process ended, and exited 0, not 141: a follower noticed its reader was gone only at its next write.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

from .serve_support import Served, wait_until

#: A follower whose reader left ends within this, in seconds (the follow pace is 0.25 s, an
#: ``events.wait`` 1 s; the rest is the CLI's start-up).
_PROMPT_SECONDS = 5.0


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
