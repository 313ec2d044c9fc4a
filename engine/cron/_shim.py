"""The exit-recording shim: runs a watched command and records how it ended, atomically, in a file.

Run as a script (``python -I -S _shim.py EXIT_FILE -- ARGV...``; standard library only, starts in ~10 ms)
as the leader of the watched command's process group. It spawns ``ARGV`` with default signal
dispositions, waits for it, writes ``{"pid", "exit_code" | "signal", "ended_at"}`` to ``EXIT_FILE`` (temp
file, fsync, rename), then ends the same way the command did. It ignores SIGINT, SIGTERM, SIGQUIT and
SIGHUP itself: those reach the command through the group, and the shim must outlive the command to record
it. So the exit survives while no engine runs: the next engine reads the file (design section 5).

The record's disk blocks are reserved before the command starts (:class:`Reserve`), so a disk the command
(or anything) fills meanwhile cannot lose it; and the shim's own exit status is always the command's, so
when a record still cannot be written the engine falls back on the right status, and the shim reports the
recording failure separately, on stderr (the watch log, when it has room).

``_shim.c`` (compiled at install time into ``_shim.bin``) and ``_shim.pl`` are the same shim in C and in
Perl, run instead of this one where they are found (they start many times sooner); this one is the last
fallback. All three take the same arguments, write the same record and end the same way
(``tests/test_cron_shim.py`` runs every test on each). The engine reads the record with
:func:`~engine.cron._exit_record.read_exit_record`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

_PASSED_ON = (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT, signal.SIGHUP)


#: Bytes reserved for the exit record before the command starts (a record is about 100 bytes).
RESERVE_BYTES = 4096


def _fsync_folder(path: str) -> None:
    folder = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


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
    _fsync_folder(path)


class Reserve:
    """The exit record's temp file, made and given its disk blocks before the command starts.

    A full disk later (the command filled it, or anything else did) then cannot stop the record: it is
    written into blocks that are already there, and renamed into place.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.tmp = f"{path}.tmp.{os.getpid()}"
        self.fd: int | None = None
        self.problem: str | None = None
        try:
            self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            os.posix_fallocate(self.fd, 0, RESERVE_BYTES)
        except OSError as exc:
            self.problem = exc.strerror or str(exc)  # go on: the write may still find room

    def write(self, data: bytes) -> str | None:
        """Write ``data`` as the record (reserved blocks first, else a fresh temp file); the failure,
        as a phrase, or ``None``."""
        try:
            if self.fd is None:
                write_atomically(self.path, data)
                return None
            os.pwrite(self.fd, data, 0)
            os.ftruncate(self.fd, len(data))
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = None
            os.rename(self.tmp, self.path)
            _fsync_folder(self.path)
        except OSError as exc:
            return exc.strerror or str(exc)
        return None


def _say(text: str) -> None:
    """One line on stderr (the watch log), if it can be written; never a reason to fail."""
    try:
        os.write(2, (text + "\n").encode("utf-8", "replace"))
    except OSError:
        pass


def _end(status: int) -> None:
    """End as the command ended: the same signal, or the same exit code (``os._exit``: no flush at exit
    can turn it into Python's 120)."""
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        if number not in (signal.SIGKILL, signal.SIGSTOP):  # those cannot be caught, nor reset
            signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
        os._exit(128 + number)  # a signal that does not end a process by default
    os._exit(os.waitstatus_to_exitcode(status))


def main(argv: list[str]) -> int:
    """Run ``argv[2:]`` (after ``EXIT_FILE --``), record its end in ``argv[0]``, end the same way.

    The command's exit status is its own whatever happens to the record: when the record cannot be
    written (a full disk that even the reserved blocks could not cover), the shim says so on stderr and
    still ends as the command did, so the engine, which then reads no record, sees the command's status.
    """
    if len(argv) < 3 or argv[1] != "--":
        print("usage: _shim.py EXIT_FILE -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    exit_file, command = argv[0], argv[2:]
    for sig in _PASSED_ON:
        signal.signal(sig, signal.SIG_IGN)
    reserve = Reserve(exit_file)
    defaults = {*_PASSED_ON, signal.SIGPIPE, signal.SIGXFSZ}
    try:
        pid = os.posix_spawnp(command[0], command, os.environ, setsigdef=defaults)
    except OSError as exc:
        _say(f"cannot run {command[0]!r}: {exc.strerror}")
        reserve.write(json.dumps({"pid": None, "exit_code": 127, "ended_at": time.time()}).encode())
        _end(127 << 8)
        return 127
    _, status = os.waitpid(pid, 0)
    record: dict[str, object] = {"pid": pid, "ended_at": time.time()}
    if os.WIFSIGNALED(status):
        record["signal"] = os.WTERMSIG(status)
    else:
        record["exit_code"] = os.waitstatus_to_exitcode(status)
    failure = reserve.write(json.dumps(record).encode())
    if failure is not None:
        reserved = f"; reserving its space failed too: {reserve.problem}" if reserve.problem else ""
        _say(
            f"gadget-engine: the exit of {command[0]!r} could not be recorded ({failure}{reserved}); "
            "the shim ends with the command's own status instead"
        )
    _end(status)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
