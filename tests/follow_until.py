"""Run a follower (``log -f``, ``events -f``, a foreground ``serve``) until it printed what a docs page
shows, or a bound passed; then SIGINT it, as a reader's Ctrl-C would.

Usage: python tests/follow_until.py LINES MIN_SECONDS MAX_SECONDS -- COMMAND...

It passes the follower's output through. It stops the follower once LINES lines were printed (after a
short settle for a last line) and MIN_SECONDS have passed, or at MAX_SECONDS; it exits 0 then, as a
follower ended by Ctrl-C does in the page.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

_SETTLE_SECONDS = 0.3


def main(argv: list[str]) -> int:
    lines, least, most = int(argv[0]), float(argv[1]), float(argv[2])
    assert argv[3] == "--"
    proc = subprocess.Popen(argv[4:], stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None
    began = time.monotonic()
    seen = 0
    enough_at: float | None = None if lines else began  # nothing shown: stop after MIN_SECONDS
    while True:
        now = time.monotonic()
        if now - began >= most or (enough_at is not None and now >= enough_at and now - began >= least):
            break
        ready, _, _ = select.select([proc.stdout], [], [], 0.05)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break  # the follower ended by itself
            sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()
            seen += chunk.count(b"\n")
            if lines and seen >= lines and enough_at is None:
                enough_at = time.monotonic() + _SETTLE_SECONDS
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    rest = proc.stdout.read()
    sys.stdout.buffer.write(rest)
    status = proc.returncode
    return 0 if status in (0, -signal.SIGINT, 130) else status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
