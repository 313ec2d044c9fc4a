"""Readiness: ``create`` returns once a new process is ready, has exited, or the wait ran out.

``ReadyCheck(log_pattern=..., port=..., timeout_seconds=30)`` names what "ready" means, as
process-compose's readiness probes and Docker's health checks do:

- **a line in the output**: ``log_pattern`` (a regular expression, run with a time bound by
  :mod:`engine._patterns`) found in stdout or stderr;
- **a listening port**: a TCP socket in ``LISTEN`` state on ``port`` that accepts on 127.0.0.1 or ::1
  (bound to a loopback or wildcard address) **and belongs to the run's tree**: its inode, from
  ``/proc/net/tcp`` and ``/proc/net/tcp6``, is one of the sockets open in a process of the run (the
  run's cgroup leaf, or its process group and the escapees found so far). A stale server of an earlier
  session on the same port is not "ready"; a new server that could not bind exits, and that is reported.

Either one is enough. The process exiting first gives ``"exited"``, the time running out ``"timeout"``;
neither kills the process. Waiting costs nothing while the output does not change: the two log files are
watched with inotify; the port is looked at after each change and on a timer that starts at
:data:`PORT_FIRST_STEP_SECONDS` and doubles up to :data:`PORT_MAX_STEP_SECONDS`. The log lock is held
only to read a bounded piece of a file, never while a pattern runs.
"""

from __future__ import annotations

import codecs
import contextlib
import ipaddress
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Final, Literal

import attrs
import trio
from inotify_simple import INotify, flags

from ._logpair import LogPair
from ._logs import STREAMS, Stream
from ._patterns import REGEX_SECONDS, Pattern, compile_pattern, search_lines
from ._supervisor import ManagedRun

__all__ = ["FIRST_OUTPUT_BYTES", "ReadyCheck", "ReadyState", "first_output", "port_ready", "wait_ready"]

_log = logging.getLogger("engine.subprocesses")

ReadyState = Literal["ready", "exited", "timeout"]

#: The most ``SubProcessSummary.first_output`` holds, in bytes.
FIRST_OUTPUT_BYTES: Final = 4096
#: The port is looked at again after this long at first, in seconds...
PORT_FIRST_STEP_SECONDS: Final = 0.02
#: ...the step doubling up to this (an idle wait looks once a second).
PORT_MAX_STEP_SECONDS: Final = 1.0
#: How much new output one look reads per stream, in bytes.
_SCAN_BYTES: Final = 1 << 20
#: The longest unfinished last line kept for the next look, in characters.
_CARRY_CHARS: Final = 64 * 1024
_TCP_LISTEN: Final = "0A"


def _port(_inst: object, _attr: attrs.Attribute[int | None], value: int | None) -> None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535
    ):
        raise ValueError(f"port must be a TCP port number from 1 to 65535, got {value!r}")


def _timeout(_inst: object, _attr: attrs.Attribute[float], value: float) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and value > 0)
    ):
        raise ValueError(f"timeout_seconds must be a finite number of seconds > 0, got {value!r}")


@attrs.frozen
class ReadyCheck:
    """When a new process counts as ready (see the module): ``create`` waits for it.

    Attributes:
        log_pattern: a regular expression (``regex`` syntax, multi-line: ``^`` and ``$`` match at each
            line) looked for in stdout and stderr.
        port: a TCP port the process (or a process of its tree) listens on, reachable on 127.0.0.1 or
            ::1.
        timeout_seconds: the longest ``create`` waits; then it returns with ``ready == "timeout"`` and
            the process goes on.

    Raises:
        ValueError: neither ``log_pattern`` nor ``port``, a pattern that does not compile, a port out of
            range, or a timeout that is not a positive finite number.
    """

    log_pattern: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(str))
    )
    port: int | None = attrs.field(default=None, validator=_port)
    timeout_seconds: float = attrs.field(default=30.0, validator=_timeout)

    def __attrs_post_init__(self) -> None:
        if self.log_pattern is None and self.port is None:
            raise ValueError("a ReadyCheck needs log_pattern or port (or both)")
        if self.log_pattern is not None:
            compile_pattern(self.log_pattern, "log_pattern")

    def to_dict(self) -> dict[str, object]:
        """The wire form: ``{"log": ..., "port": ..., "timeout": ...}`` (what the tool and RPC take)."""
        out: dict[str, object] = {"timeout": self.timeout_seconds}
        if self.log_pattern is not None:
            out["log"] = self.log_pattern
        if self.port is not None:
            out["port"] = self.port
        return out


# ---- the port ------------------------------------------------------------------------------------------


def _loopback_reachable(hex_address: str) -> bool:
    """Whether a ``/proc/net/tcp{,6}`` local address accepts connections to 127.0.0.1 or ::1."""
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        address: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.IPv4Address(raw[::-1])
    else:  # four 32-bit words, each in host (little-endian) order
        address = ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
        if address.ipv4_mapped is not None:
            address = address.ipv4_mapped
    return address.is_loopback or address.is_unspecified


def listening_inodes(port: int) -> set[int]:
    """The inodes of TCP sockets listening on ``port`` that accept on 127.0.0.1 or ::1."""
    found: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii", errors="replace") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _TCP_LISTEN:
                continue
            address, _, hex_port = fields[1].partition(":")
            try:
                if int(hex_port, 16) == port and _loopback_reachable(address):
                    found.add(int(fields[9]))
            except ValueError:
                continue
    return found


def socket_inodes(pids: Iterable[int]) -> set[int]:
    """The inodes of the sockets open in processes ``pids`` (a process gone meanwhile is skipped)."""
    found: set[int] = set()
    for pid in pids:
        folder = f"/proc/{pid}/fd"
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            try:
                target = os.readlink(f"{folder}/{name}")
            except OSError:
                continue
            if target.startswith("socket:["):
                with contextlib.suppress(ValueError):
                    found.add(int(target[8:-1]))
    return found


def port_ready(port: int, pids: Iterable[int]) -> bool:
    """Whether a socket of processes ``pids`` listens on ``port``, reachable on 127.0.0.1 or ::1."""
    listening = listening_inodes(port)
    return bool(listening) and not listening.isdisjoint(socket_inodes(pids))


# ---- the output ----------------------------------------------------------------------------------------


def first_output(logs: LogPair) -> str:
    """The first lines of stdout, then of stderr: whole lines within :data:`FIRST_OUTPUT_BYTES` in all
    (a last line without its newline counts when the file holds nothing more)."""
    out = b""
    for stream in STREAMS:
        room = FIRST_OUTPUT_BYTES - len(out)
        if room <= 0:
            break
        try:
            piece = logs.read_raw(stream, None, room + 1)
        except OSError:
            continue
        data = piece.data
        if len(data) > room:
            cut = data.rfind(b"\n", 0, room)
            data = data[: cut + 1] if cut >= 0 else b""
        out += data
    return out.decode("utf-8", "replace")


@attrs.define(eq=False)
class _Scan:
    """Where the pattern scan of one stream is: the next offset and the unfinished last line."""

    offset: int | None = None
    carry: str = ""
    decoder: codecs.IncrementalDecoder = attrs.field(
        factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )


def _matches(pattern: Pattern, text: str) -> bool:
    """Whether ``pattern`` matches in ``text`` within :data:`REGEX_SECONDS` (a timeout is no match)."""
    try:
        return next(search_lines(pattern, text, time.monotonic() + REGEX_SECONDS), None) is not None
    except TimeoutError:
        _log.warning(
            "a readiness pattern ran out of time on %d characters; those lines are skipped", len(text)
        )
        return False


async def _pattern_seen(pattern: Pattern, logs: LogPair, lock: trio.Lock, scans: dict[Stream, _Scan]) -> bool:
    """Read what is new in each stream (under ``lock``, one bounded piece at a time) and look for
    ``pattern`` in it (in a worker thread, without the lock)."""
    for stream, scan in scans.items():
        while True:
            async with lock:
                try:
                    piece = await trio.to_thread.run_sync(logs.read_raw, stream, scan.offset, _SCAN_BYTES)
                except OSError:
                    break
            if not piece.data:
                break
            scan.offset = piece.start + len(piece.data)
            text = scan.carry + scan.decoder.decode(piece.data)
            if await trio.to_thread.run_sync(_matches, pattern, text, abandon_on_cancel=True):
                return True
            scan.carry = text[text.rfind("\n") + 1 :][-_CARRY_CHARS:]
            if len(piece.data) < _SCAN_BYTES:
                break
    return False


@attrs.define(eq=False)
class _Wake:
    """Something changed (a log file was written, the leader exited): look again."""

    _event: trio.Event = attrs.field(init=False, factory=trio.Event)

    def set(self) -> None:
        self._event.set()

    async def wait(self) -> None:
        """Wait for a change since the last wait returned (one made meanwhile returns at once)."""
        await self._event.wait()
        self._event = trio.Event()


@asynccontextmanager
async def _watch_files(paths: Iterable[str], changed: _Wake) -> AsyncIterator[None]:
    """Call ``changed.set()`` whenever a file of ``paths`` is written."""
    try:
        inotify = INotify(nonblocking=True)
    except OSError as exc:  # no inotify instance left: the caller's timer steps still wake it
        _log.warning("readiness: no inotify (%s); looking at the logs on a timer", exc)
        yield
        return
    try:
        for path in paths:
            with contextlib.suppress(OSError):
                inotify.add_watch(path, flags.MODIFY | flags.DONT_FOLLOW)

        async def read_events() -> None:
            while True:
                await trio.lowlevel.wait_readable(inotify.fileno())
                if inotify.read(timeout=0):
                    changed.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_events)
            yield
            nursery.cancel_scope.cancel()
    finally:
        trio.lowlevel.notify_closing(inotify.fileno())
        inotify.close()


async def wait_ready(check: ReadyCheck, run: ManagedRun, logs: LogPair, lock: trio.Lock) -> ReadyState:
    """Wait until ``run`` is ready by ``check``, has exited, or ``check.timeout_seconds`` passed.

    Args:
        check: what ready means.
        run: the new process.
        logs: its log files.
        lock: the service's log lock (held only while a bounded piece of a file is read).

    Cancellation: safe; the process goes on.

    Returns:
        ``"ready"``, ``"exited"`` (the process exited first; a match in what it wrote still counts as
        ready) or ``"timeout"``.
    """
    pattern = compile_pattern(check.log_pattern, "log_pattern") if check.log_pattern is not None else None
    scans = {stream: _Scan() for stream in STREAMS}
    wake = _Wake()

    async def leader_exit() -> None:
        await run.wait_leader_exit()
        wake.set()

    async def look() -> ReadyState:
        step = PORT_FIRST_STEP_SECONDS
        while True:
            exited = run.leader_exit is not None
            if pattern is not None and await _pattern_seen(pattern, logs, lock, scans):
                return "ready"
            if check.port is not None and port_ready(check.port, run.pids()):
                return "ready"
            if exited:
                return "exited"
            with trio.move_on_after(step if check.port is not None else PORT_MAX_STEP_SECONDS):
                await wake.wait()
            step = min(step * 2, PORT_MAX_STEP_SECONDS)

    found: ReadyState = "timeout"
    with trio.move_on_after(check.timeout_seconds):
        async with _watch_files(logs.paths, wake), trio.open_nursery() as nursery:
            nursery.start_soon(leader_exit)
            found = await look()
            nursery.cancel_scope.cancel()  # caught by the nursery itself: ``found`` stands
    return found
