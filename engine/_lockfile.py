"""What the state directory's lock file says: the pid of the engine that holds it, and its phase.

The engine holds an exclusive ``flock`` on ``<state_dir>/lock`` for its lifetime (``open_engine``); the
file's one line is ``<pid> <phase> <kind>``, rewritten as the engine goes through its phases, so that a
client that cannot connect tells why without a socket to look at (``server._client``). The kind is
``serve`` (``gadget-engine serve``, which listens once open), ``mcp`` (``gadget-engine mcp``'s own
engine, which listens once open too, but is stopped through its stdin, never by a signal from ``stop``)
or ``embedded`` (``open_engine`` in another program: it never listens). The phases:

- ``starting``: written as the lock is taken; the engine ends what a crashed one left (the start-up
  sweep, up to its grace period, then SIGKILL and the kill wait) and opens its services;
- ``open``: the engine is open (``open_engine`` yielded it); an embedded engine stays so, ``serve`` binds
  its socket next;
- ``serving``: ``serve`` listens on its socket;
- ``stopping``: the engine stops (``serve`` stopped listening, or ``open_engine``'s block is left).

An engine of an earlier version wrote its pid alone: its phase and kind read as ``""``.

Standard library only: the clients import this module.
"""

from __future__ import annotations

import os
from typing import Final, NamedTuple

from ._trust import open_own_file

__all__ = [
    "EMBEDDED",
    "LOCK_NAME",
    "MCP",
    "OPEN",
    "SERVE",
    "SERVING",
    "STARTING",
    "STOPPING",
    "LockLine",
    "mark_phase",
    "parse_lock_line",
    "write_phase",
]

#: The lock file's name in the state directory.
LOCK_NAME: Final = "lock"
STARTING: Final = "starting"
OPEN: Final = "open"
SERVING: Final = "serving"
STOPPING: Final = "stopping"
SERVE: Final = "serve"
EMBEDDED: Final = "embedded"
MCP: Final = "mcp"


class LockLine(NamedTuple):
    """The lock file's line, parsed."""

    #: the pid the engine wrote, as text (``""`` when the file is empty: the lock was just taken)
    pid: str
    #: its phase (``""`` for an earlier version's pid-only line)
    phase: str
    #: ``serve``, ``mcp`` or ``embedded`` (``""`` likewise)
    kind: str


def parse_lock_line(text: str) -> LockLine:
    """``"4242 serving serve\\n"`` -> ``LockLine("4242", "serving", "serve")``; what is not a pid reads as
    ``("", "", "")``."""
    words = text.split("\n", 1)[0].split()
    if not words or not words[0].isdigit():
        return LockLine("", "", "")
    words += ["", ""]
    return LockLine(words[0], words[1], words[2])


def write_phase(fd: int, phase: str, kind: str) -> None:
    """Write this process's pid, ``phase`` and ``kind`` (``serve``, ``mcp``, ``embedded``) as the lock
    file's line, through ``fd`` (open for writing).

    One ``pwrite`` at offset 0, then the file cut to that line: a reader sees the old line or the new one
    (the tail of a longer old line, past the newline, is not read).
    """
    line = f"{os.getpid()} {phase} {kind}\n".encode("ascii")
    os.pwrite(fd, line, 0)
    os.ftruncate(fd, len(line))


def mark_phase(state_dir: str, phase: str, kind: str = SERVE) -> None:
    """:func:`write_phase` on ``<state_dir>/lock`` by its path, for the engine that holds the lock.

    Raises:
        OSError: the file cannot be opened or written (``UntrustedPathError`` when it is not the engine's
            own regular file).
    """
    fd = open_own_file(os.path.join(state_dir, LOCK_NAME), os.O_WRONLY, what="the state directory's lock")
    try:
        write_phase(fd, phase, kind)
    finally:
        os.close(fd)
