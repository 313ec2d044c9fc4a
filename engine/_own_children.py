"""The engine's own children, read through descriptors kept open on each of its threads' ``children``
file (:class:`OwnChildren`).

``/proc/self/task/<tid>/children`` lists the children of one thread; the engine's children are those of
all its threads. Read by path, each look lists ``/proc/self/task`` and opens, reads and closes one file
per thread: 10-17 us with one thread, 42-72 us with five (Trio's worker threads, the log folders'
threads: the benchmark's spawn rounds run with five), and a process-group run's end makes one or two such
looks. Kept open, a look is a ``fstat`` of the task folder, a ``pread`` per thread and two looks at
:func:`threading.enumerate`: 13-25 us with five threads.

The descriptors stand for the threads they were opened on. A look uses them only while the kernel counts
exactly the Python threads they were opened for (the link count of the task folder is two plus one per
thread), the same :class:`threading.Thread` objects before and after the reads: a thread that ends leaves
:func:`threading.enumerate` before it ends in the kernel, and one that starts is counted by the kernel
before it can run any code, so a change during the look is seen and the look is made again from a fresh
listing. Where the process has threads Python did not start (an embedding host's), the kept descriptors
never serve and every look reads by path, as before.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Final, final

import attrs

__all__ = ["LINKS_BESIDE_THREADS", "NO_CHILDREN_FILES", "OwnChildren", "open_thread_children", "read_list"]

#: ``/proc/<pid>/task`` links: ``.``, the entry in ``/proc/<pid>``, and one per thread.
LINKS_BESIDE_THREADS: Final = 2
#: Reads of a list the kernel makes afresh from offset 0; a read shorter than this is the whole list.
_READ_SIZE: Final = 65536


#: :func:`open_thread_children`'s answer when the kernel has no ``children`` files (built without
#: ``CONFIG_PROC_CHILDREN``): callers scan ``/proc`` instead.
NO_CHILDREN_FILES: Final = -2


def open_thread_children(pid: int, tid: str) -> int | None:
    """A descriptor (close on exec) on ``/proc/<pid>/task/<tid>/children``, the children of one thread;
    ``None`` when the thread (or the process) ended meanwhile; :data:`NO_CHILDREN_FILES` when the thread
    is there but the kernel has no such file."""
    try:
        return os.open(f"/proc/{pid}/task/{tid}/children", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return NO_CHILDREN_FILES if os.path.exists(f"/proc/{pid}/task/{tid}") else None
    except ProcessLookupError:
        return None


def read_list(fd: int) -> bytes:
    """All of a ``/proc`` list file open on ``fd`` (``children``), read from its start: the kernel makes
    it afresh at each read from offset 0, and a read shorter than asked is its end, so one read is the
    usual cost."""
    data = os.pread(fd, _READ_SIZE, 0)
    while data and len(data) % _READ_SIZE == 0:
        more = os.pread(fd, _READ_SIZE, len(data))
        if not more:
            break
        data += more
    return data


#: Every :class:`OwnChildren`, for the fork hook below.
_instances: weakref.WeakSet[OwnChildren] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for own in list(_instances):
        own._after_fork()


@final
@attrs.define(eq=False, weakref_slot=True)
class OwnChildren:
    """This process's children, through descriptors kept on its threads' ``children`` files.

    Thread-safe: the engine's loop reads it, and so does the blocking escalation driver in a worker
    thread (``Supervisor.end_processes``, the start-up sweep); one look at a time, under a lock (a look
    costs 10-70 us).
    """

    #: the process the descriptors belong to (a forked child starts afresh)
    _pid: int = attrs.field(init=False, default=-1)
    _task_fd: int = attrs.field(init=False, default=-1)
    #: the Python threads the descriptors were opened for, by identity, and the descriptors
    _threads: tuple[threading.Thread, ...] = attrs.field(init=False, default=())
    _fds: tuple[int, ...] = attrs.field(init=False, default=())
    #: how many looks listed the threads and read by path (the others read the kept descriptors)
    listings: int = attrs.field(init=False, default=0)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock, repr=False)

    def __attrs_post_init__(self) -> None:
        _instances.add(self)

    def _after_fork(self) -> None:
        """In a fork's child: a new lock (another thread of the parent may have held this one), and the
        inherited descriptors closed (they name the parent's threads)."""
        self._lock = threading.Lock()
        self._close()

    @property
    def kept(self) -> int:
        """How many threads' descriptors are kept now (0: the next look reads by path)."""
        return len(self._fds)

    def read(self) -> list[int] | None:
        """The pids of this process's children (of any of its threads); ``None`` when the kernel has
        no ``children`` files (callers scan ``/proc`` then).

        Raises:
            OSError: ``/proc`` cannot be read (as a read by path would).
        """
        with self._lock:
            return self._read()

    def _read(self) -> list[int] | None:
        pid = os.getpid()
        if pid != self._pid:
            self._close()
            try:
                self._task_fd = os.open(f"/proc/{pid}/task", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except FileNotFoundError:
                return None  # no /proc/<pid>/task: callers scan /proc
            self._pid = pid
        before = threading.enumerate()
        links = os.fstat(self._task_fd).st_nlink
        if self._serves(before, links):
            pids = [int(p) for fd in self._fds for p in read_list(fd).split()]
            if self._serves(threading.enumerate(), os.fstat(self._task_fd).st_nlink):
                return pids
        return self._read_fresh(pid)

    def _serves(self, threads: list[threading.Thread], links: int) -> bool:
        """Whether the kept descriptors are one per thread of the process now: the kernel counts as
        many threads as ``threads``, and they are the very ones the descriptors were opened for."""
        if links - LINKS_BESIDE_THREADS != len(threads) or len(threads) != len(self._threads):
            return False
        return all(a is b for a, b in zip(threads, self._threads, strict=True))

    def _read_fresh(self, pid: int) -> list[int] | None:
        """Read by path, and keep descriptors for the next looks when every thread is a Python one."""
        self.listings += 1
        threads = threading.enumerate()
        tids = os.listdir(f"/proc/{pid}/task")
        current = threading.current_thread()  # a fork's child: the thread's own id, not the parent's
        tid_of = {t: str(threading.get_native_id() if t is current else t.native_id) for t in threads}
        keep = len(tids) == len(threads) and set(tids) == set(tid_of.values())
        fds: dict[str, int] = {}
        pids: list[int] = []
        no_files = False  # the kernel has no children files (built without CONFIG_PROC_CHILDREN)
        try:
            for tid in tids:
                fd = open_thread_children(pid, tid)
                if fd == NO_CHILDREN_FILES:
                    no_files = True
                    break
                if fd is None:  # the thread ended meanwhile
                    keep = False
                    continue
                fds[tid] = fd
                pids.extend(int(p) for p in read_list(fd).split())
        except BaseException:
            for fd in fds.values():
                os.close(fd)
            raise
        if no_files:
            for fd in fds.values():
                os.close(fd)
            return None
        self._drop_threads()
        if keep and threading.enumerate() == threads:
            # In the order threading.enumerate() gives them, which :meth:`_serves` compares with.
            self._threads = tuple(threads)
            self._fds = tuple(fds[tid_of[t]] for t in threads)
        else:
            for fd in fds.values():
                os.close(fd)
        return pids

    def _drop_threads(self) -> None:
        fds, self._fds, self._threads = self._fds, (), ()
        for fd in fds:
            os.close(fd)

    def close(self) -> None:
        """Close every descriptor (a fork's child does this to those it inherited, unused)."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        self._drop_threads()
        if self._task_fd >= 0:
            fd, self._task_fd = self._task_fd, -1
            os.close(fd)  # in a fork's child, its own copy
        self._pid = -1


os.register_at_fork(after_in_child=_after_fork_in_child)
