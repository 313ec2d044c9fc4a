"""The exit-recording shim: runs a watched command and records how it ended, atomically, in a file.

Run as a script (``python -I -S _shim.py EXIT_FILE -- ARGV...``; standard library only, starts in ~10 ms)
as the leader of the watched command's process group. It spawns ``ARGV`` with default signal
dispositions, waits for it, writes ``{"pid", "exit_code" | "signal", "ended_at"}`` to ``EXIT_FILE`` (temp
file, fsync, rename), then ends the same way the command did. It ignores SIGINT, SIGTERM, SIGQUIT and
SIGHUP itself: those reach the command through the group, and the shim must outlive the command to record
it. So the exit survives while no engine runs: the next engine reads the file (design section 5).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

_PASSED_ON = (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT, signal.SIGHUP)


def write_atomically(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file, fsync and rename (then fsync the folder)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    folder = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def main(argv: list[str]) -> int:
    """Run ``argv[2:]`` (after ``EXIT_FILE --``), record its end in ``argv[0]``, end the same way."""
    if len(argv) < 3 or argv[1] != "--":
        print("usage: _shim.py EXIT_FILE -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    exit_file, command = argv[0], argv[2:]
    for sig in _PASSED_ON:
        signal.signal(sig, signal.SIG_IGN)
    defaults = {*_PASSED_ON, signal.SIGPIPE, signal.SIGXFSZ}
    try:
        pid = os.posix_spawnp(command[0], command, os.environ, setsigdef=defaults)
    except OSError as exc:
        print(f"cannot run {command[0]!r}: {exc.strerror}", file=sys.stderr)
        write_atomically(
            exit_file, json.dumps({"pid": None, "exit_code": 127, "ended_at": time.time()}).encode()
        )
        return 127
    _, status = os.waitpid(pid, 0)
    record: dict[str, object] = {"pid": pid, "ended_at": time.time()}
    if os.WIFSIGNALED(status):
        record["signal"] = os.WTERMSIG(status)
    else:
        record["exit_code"] = os.waitstatus_to_exitcode(status)
    write_atomically(exit_file, json.dumps(record).encode())
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        if number not in (signal.SIGKILL, signal.SIGSTOP):  # those cannot be caught, nor reset
            signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
        return 128 + number  # a signal that does not end a process by default
    return os.waitstatus_to_exitcode(status)


def read_exit_file(path: str) -> dict[str, object] | None:
    """The record the shim wrote, or ``None`` when there is none (or it is unreadable)."""
    try:
        with open(path, "rb") as f:
            value = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
