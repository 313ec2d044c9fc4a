"""Reading the process table from ``/proc`` and making the engine a child subreaper.

Everything here is synchronous and cheap: one ``/proc`` scan reads ``/proc/<pid>/stat`` for every process
(about 10 us each). A process is named by ``(pid, start_time)`` so that a reused pid is never mistaken for
ours (design section 8: "a reaped pid is free for reuse").
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

from . import _libc
from ._own_children import (
    LINKS_BESIDE_THREADS,
    NO_CHILDREN_FILES,
    OwnChildren,
    open_thread_children,
    read_list,
)

__all__ = [
    "GUARDIAN_VAR",
    "RUN_MARKER_VAR",
    "ProcInfo",
    "add_helper",
    "children_by_fds",
    "children_of",
    "children_read_at",
    "children_read_size",
    "drop_helper",
    "engine_children",
    "engine_helpers",
    "is_alive",
    "is_child_subreaper",
    "now_ticks",
    "open_children_of",
    "read_kernel_file",
    "read_marker",
    "read_proc",
    "scan_processes",
    "set_child_subreaper",
    "sharing_children_reads",
]

#: The environment variable of the guardian process (its value: the state dir); it is the engine's.
GUARDIAN_VAR = "GADGET_ENGINE_GUARDIAN"

#: The environment variable every child gets, naming its run (``<supervisor token>:<run id>``); like
#: Jenkins' ``BUILD_ID`` or systemd's ``INVOCATION_ID`` it lets the engine attribute a descendant that
#: left the process group (``setsid``) and was re-parented to the engine.
RUN_MARKER_VAR = "GADGET_ENGINE_RUN"

_PF_KTHREAD = 0x00200000
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


class ProcInfo(NamedTuple):
    """One line of the process table.

    Attributes:
        pid: process id.
        ppid: parent pid.
        pgid: process group id.
        sid: session id.
        state: the one-letter state of ``/proc/<pid>/stat`` (``R``, ``S``, ``T``, ``Z``, ...).
        start_time: start time in clock ticks since boot; with ``pid`` it names a process uniquely.
        flags: the kernel's ``PF_*`` flags of the process.
    """

    pid: int
    ppid: int
    pgid: int
    sid: int
    state: str
    start_time: int
    flags: int = 0

    @property
    def kernel_thread(self) -> bool:
        """Whether this is a kernel thread (``PF_KTHREAD``): no environment, never one of ours."""
        return bool(self.flags & _PF_KTHREAD)

    @property
    def zombie(self) -> bool:
        """Whether the process has exited and waits to be reaped (state ``Z`` or ``X``)."""
        return self.state in ("Z", "X")


def _parse_stat(pid: int, data: bytes) -> ProcInfo | None:
    # The command name is in parentheses and may itself hold ')' or spaces: split after the last ')'.
    end = data.rfind(b")")
    if end < 0:
        return None
    fields = data[end + 2 :].split()
    try:
        return ProcInfo(
            pid=pid,
            ppid=int(fields[1]),
            pgid=int(fields[2]),
            sid=int(fields[3]),
            state=fields[0].decode("ascii", "replace"),
            start_time=int(fields[19]),
            flags=int(fields[6]),
        )
    except (IndexError, ValueError):
        return None


#: One ``read`` gets the whole stat line (about 300 bytes; 52 numeric fields and a 64-byte name at most).
_STAT_READ = 4096


def read_kernel_file(path: str, chunk: int) -> bytes:
    """The whole content of a small kernel file (``/proc``, ``/sys/fs/cgroup``), read ``chunk`` bytes at a
    time with ``os.read``: no buffered file object per file, about 40% less time per ``stat`` file, and an
    escalation reads thousands of them (``benchmarks/terminate.py``).

    Raises:
        OSError: as ``os.open`` / ``os.read`` (``FileNotFoundError`` for a process that is gone).
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(fd, chunk)
        while len(data) % chunk == 0 and data:
            more = os.read(fd, chunk)
            if not more:
                break
            data += more
    finally:
        os.close(fd)
    return data


def read_proc(pid: int) -> ProcInfo | None:
    """Read one process's ``/proc/<pid>/stat``; ``None`` when no such process exists (not even a zombie)."""
    try:
        data = read_kernel_file(f"/proc/{pid}/stat", _STAT_READ)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return _parse_stat(pid, data)


def now_ticks() -> int:
    """Now, in the clock ticks since boot that ``/proc/<pid>/stat`` start times count in."""
    with open("/proc/uptime", encoding="ascii") as f:
        uptime = float(f.read().split()[0])
    return int(uptime * os.sysconf("SC_CLK_TCK"))


def scan_processes() -> Iterator[ProcInfo]:
    """Yield every process in ``/proc``; processes that vanish during the scan are skipped."""
    for name in os.listdir("/proc"):
        if name.isdigit():
            info = read_proc(int(name))
            if info is not None:
                yield info


def is_alive(pid: int, start_time: int) -> bool:
    """Whether the process ``(pid, start_time)`` still exists and has not exited (a zombie is not alive)."""
    info = read_proc(pid)
    return info is not None and info.start_time == start_time and not info.zombie


#: The link count of ``/proc/<pid>/task`` for a process of one thread (see :func:`children_of`).
_ONE_THREAD_LINKS = LINKS_BESIDE_THREADS + 1


def children_of(pid: int) -> list[int] | None:
    """The children of ``pid`` (of any of its threads), from ``/proc/<pid>/task/<tid>/children``.

    ``[]`` when the process is gone; ``None`` when the kernel has no such files (built without
    ``CONFIG_PROC_CHILDREN``), and callers fall back to a full scan.

    A process with one thread (the kernel counts the threads in the link count of ``/proc/<pid>/task``:
    two plus one per thread) has only its own file to read: a ``stat`` costs about half a listing of the
    folder, and a ``kill_all`` looks at 1000 leaders just before their SIGKILL.
    """
    try:
        if os.stat(f"/proc/{pid}/task").st_nlink == _ONE_THREAD_LINKS:
            tids: list[str] = [str(pid)]
        else:
            tids = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return []
    pids: list[int] = []
    for tid in tids:
        fd = open_thread_children(pid, tid)
        if fd == NO_CHILDREN_FILES:
            return None
        if fd is None:  # the thread ended meanwhile
            continue
        try:
            pids.extend(map(int, read_list(fd).split()))
        finally:
            os.close(fd)
    return pids


def open_children_of(pid: int) -> tuple[int, int] | None:
    """Descriptors on ``/proc/<pid>/task`` and ``/proc/<pid>/task/<pid>/children``, for
    :func:`children_by_fds` (both close on exec); ``None`` when they cannot be opened (the process gone,
    no ``CONFIG_PROC_CHILDREN``, or no descriptor left). They stand for that very process, never for
    another that takes its pid later; the caller closes them."""
    try:
        task = os.open(f"/proc/{pid}/task", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        kids = os.open(f"/proc/{pid}/task/{pid}/children", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        os.close(task)
        return None
    return task, kids


def children_by_fds(task_fd: int, children_fd: int) -> list[int] | None:
    """:func:`children_of` through the descriptors :func:`open_children_of` opened: a ``fstat`` and a
    ``pread`` (the kernel makes the list afresh at each read from offset 0), about a fifth of a read by
    path. ``None`` when the process has more than one thread now, or the files cannot be read: the caller
    reads by path then."""
    try:
        if os.fstat(task_fd).st_nlink != _ONE_THREAD_LINKS:
            return None
        data = read_list(children_fd)
    except OSError:
        return None
    return [int(p) for p in data.split()]


_recent_children: tuple[float, frozenset[int]] = (-1.0, frozenset())
#: The descriptors :func:`engine_children` reads the engine's children through.
_own_children = OwnChildren()
#: While set (:func:`sharing_children_reads`), a look that accepts an old list accepts one read since then.
_shared_since: float | None = None


@contextlib.contextmanager
def sharing_children_reads() -> Iterator[None]:
    """Within the block, every :func:`engine_children` call that accepts a list read a moment ago
    (``max_age_seconds``) accepts one read since the block began, however long the block takes: one
    pass over many escalations (a batch, ``_escalation_batch``) then reads the list once.
    """
    global _shared_since
    before, _shared_since = _shared_since, time.monotonic()
    try:
        yield
    finally:
        _shared_since = before


def engine_children(*, max_age_seconds: float = 0.0, read_since: float | None = None) -> frozenset[int]:
    """The pids whose parent is this process (any of its threads), adopted orphans included.

    Uses ``/proc/self/task/<tid>/children`` where the kernel has it, through descriptors kept on each
    thread's file while the threads stay the same (``_own_children``), else one full scan. With 1000
    children one read costs about 0.5 ms (the kernel walks its list of children), so many escalations
    at once (``kill_all``) share reads where that is safe.

    Args:
        max_age_seconds: accept a list read at most this long ago (many escalations starting together,
            as in ``kill_all``, then share one read of a list that holds every child of the engine).
        read_since: accept a list read at this :func:`time.monotonic` instant or later, whatever its
            age (:func:`children_read_at` tells when the list now kept was read).
    """
    global _recent_children
    read_at, cached = _recent_children
    now = time.monotonic()
    if max_age_seconds > 0 and (
        now - read_at <= max_age_seconds or (_shared_since is not None and read_at >= _shared_since)
    ):
        return cached
    if read_since is not None and read_at >= read_since:
        return cached
    me = os.getpid()
    pids = _own_children.read()
    found = frozenset(p.pid for p in scan_processes() if p.ppid == me) if pids is None else frozenset(pids)
    _recent_children = (now, found)
    return found


#: The engine's own helper processes (its guardians): children of this process that lead no run and that
#: only their owner reaps, so that a pid here names that very process until :func:`drop_helper`.
_helpers: frozenset[int] = frozenset()


def add_helper(pid: int) -> None:
    """Name ``pid``, a child this process just started and will reap itself (a guardian), as the engine's
    own: the looks for a run's orphans among the engine's children leave it out without reading its
    ``/proc`` files (some 15-45 us each look, per helper)."""
    global _helpers
    _helpers = _helpers | {pid}


def drop_helper(pid: int) -> None:
    """Forget a helper once its owner reaped it (its pid is free for reuse from then on)."""
    global _helpers
    _helpers = _helpers - {pid}


def engine_helpers() -> frozenset[int]:
    """The helpers named by :func:`add_helper` (the same object until the next change)."""
    return _helpers


def _forget_helpers_in_child() -> None:
    global _helpers
    _helpers = frozenset()  # a fork's child has none of its parent's children


os.register_at_fork(after_in_child=_forget_helpers_in_child)


def children_read_size() -> int:
    """How many pids the list :func:`engine_children` keeps holds (0 before any read)."""
    return len(_recent_children[1])


def children_read_at() -> float:
    """When the list :func:`engine_children` keeps was read (:func:`time.monotonic`; -1 before any)."""
    return _recent_children[0]


def read_marker(pid: int, var: str = RUN_MARKER_VAR) -> str | None:
    """The value of :data:`RUN_MARKER_VAR` (or ``var``) in a live process's environment, or ``None``.

    While a process is in the middle of ``exec`` the kernel shows its environment as empty for a moment
    (the new memory map is in place, its environment bounds not yet); an empty read of a live, non-zombie
    process is therefore retried for up to ~10 ms instead of being taken as "not ours".
    """
    for _ in range(_MARKER_READ_TRIES):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                data = f.read()
        except OSError:
            return None
        if data:
            break
        info = read_proc(pid)
        if info is None or info.zombie or info.kernel_thread:
            return None
        time.sleep(_MARKER_RETRY_SECONDS)
    else:
        return None
    prefix = var.encode() + b"="
    for entry in data.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode("utf-8", "replace")
    return None


_MARKER_READ_TRIES = 40
_MARKER_RETRY_SECONDS = 0.00025


def children_map(procs: Iterable[ProcInfo]) -> dict[int, list[ProcInfo]]:
    """Group a scan by parent pid."""
    out: dict[int, list[ProcInfo]] = {}
    for p in procs:
        out.setdefault(p.ppid, []).append(p)
    return out


_subreaper_lock = threading.Lock()
_subreaper_users = 0
_subreaper_before = 0


def _prctl() -> Callable[..., int] | None:
    return _libc.function("prctl")


def set_child_subreaper(enable: bool) -> bool:
    """Turn ``PR_SET_CHILD_SUBREAPER`` on (counted per user) or off again when the last user leaves.

    As a subreaper the engine becomes the parent of every orphaned descendant, so a process that left its
    group with ``setsid`` can still be signalled and reaped at once instead of waiting for init.

    Returns:
        ``True`` when the attribute is in force after the call (always ``False`` off Linux).
    """
    global _subreaper_users, _subreaper_before
    prctl = _prctl()
    if prctl is None:
        return False
    with _subreaper_lock:
        if enable:
            if _subreaper_users == 0:
                value = ctypes.c_int(0)
                prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(value), 0, 0, 0)
                _subreaper_before = value.value
                if prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
                    return False
            _subreaper_users += 1
            return True
        if _subreaper_users > 0:
            _subreaper_users -= 1
            if _subreaper_users == 0 and not _subreaper_before:
                prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        return _subreaper_users > 0 or bool(_subreaper_before)


def is_child_subreaper() -> bool:
    """Whether this process is a child subreaper right now (``PR_GET_CHILD_SUBREAPER``)."""
    prctl = _prctl()
    if prctl is None:
        return False
    value = ctypes.c_int(0)
    return prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(value), 0, 0, 0) == 0 and bool(value.value)
