"""The log folders already walked, kept open (:class:`FolderCache`), and the files made ahead in them.

A create walks a project's log folder once (``_logdir.LogFolder.make_opened``) and then only checks it
again; the next creates' unnamed log files (``O_TMPFILE``) are made ahead, by a thread of the cache's own
where the filesystem is slow.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from typing import Final, final

import attrs

from ._logdir import DIR_FLAGS, LogFolder, ensure_gitignore, gitignore_seen, others_may_write

__all__ = ["SLOW_FILE_SECONDS", "FolderCache", "Unnamed"]

_log = logging.getLogger("engine.subprocesses")

#: A file made ahead that took longer than this (wall time) has the next ones made by the cache's thread.
SLOW_FILE_SECONDS: Final = 20e-6


@final
@attrs.define(eq=False)
class _Opened:
    """One cached folder: the descriptors of ``base`` and of each folder down to the log folder (each
    opened without following a link when it was walked), and their identities."""

    folder: LogFolder
    fds: tuple[int, ...]
    identities: tuple[tuple[int, int], ...]
    #: Unnamed files made ahead in the log folder (``FolderCache.prepare``), with their identities.
    spare: list[Unnamed] = attrs.field(factory=list)
    #: Files the background maker is making for this entry now (``FolderCache`` with ``background``).
    pending: int = 0
    closed: bool = False
    #: the log folder's ``.gitignore`` as :func:`gitignore_seen` saw it once it was the engine's
    ignore_seen: tuple[int, int, int, int] | None = None

    def close(self) -> None:
        self.closed = True
        for fd, _ in self.spare:
            os.close(fd)
        self.spare.clear()
        for fd in self.fds:
            os.close(fd)


#: An unnamed (``O_TMPFILE``) file's descriptor and its ``(st_dev, st_ino)``.
Unnamed = tuple[int, tuple[int, int]]
#: A job of the cache's thread: the entry, the thread's own descriptor of its folder, the maker, a count.
_Job = tuple[_Opened, int, Callable[[int], Unnamed], int]


def _identity(info: os.stat_result) -> tuple[int, int]:
    return info.st_dev, info.st_ino


@final
@attrs.define(eq=False)
class FolderCache:
    """The log folders already walked, kept open: a create walks a project's folders once, not each time.

    A cached folder is checked again at each :meth:`open`, without following a link and without opening
    anything: the project directory must still be the one opened (``stat``), each folder on the way must
    still be the very directory the walk opened (``lstat`` in its parent's descriptor: a link, another
    folder or nothing there fails), and the log folder is set back to 0700 and given its ``.gitignore``
    when they were changed or removed since, as a walk does. A check that fails drops the entry and walks
    again (:meth:`LogFolder.make_opened`), which reports a link or a stranger's folder as before.

    With ``background``, :meth:`prepare` hands the making of the files ahead to a thread of the cache's
    own while making them is slow: a file is a filesystem allocation that costs 5 us on a quiet ext4 and
    100-400 us where other processes churn files in the same block groups (``analysis.md``), work the
    engine's loop need not wait for; below :data:`SLOW_FILE_SECONDS` a file the loop makes itself costs
    less than waking the thread. The thread holds a descriptor of its own of the folder (the cache may
    close its entry meanwhile: the files are then closed, never handed out), starts at the first job and
    ends with :meth:`close`. The loop never waits for it (a lock the thread holds is not waited for:
    nothing is handed over then), and nothing depends on it: a create that finds no file made ahead makes
    its own.

    Attributes:
        limit: how many folders are kept open (the least recently used is closed past it).
        background: make the files ahead in the cache's thread instead of in :meth:`prepare`.
    """

    limit: int = 32
    background: bool = False
    _entries: dict[tuple[str, str | None], _Opened] = attrs.field(init=False, factory=dict)
    #: Guards what the thread shares: each entry's ``spare``, ``pending`` and ``closed``, and the jobs.
    _lock: threading.Condition = attrs.field(init=False, factory=threading.Condition, repr=False)
    _jobs: list[_Job] = attrs.field(init=False, factory=list, repr=False)
    #: The cache's thread; one that is no longer this ends once it is done with its job (:meth:`close`).
    _thread: threading.Thread | None = attrs.field(init=False, default=None, repr=False)
    #: Whether the last files made took more than :data:`SLOW_FILE_SECONDS` each: only then does the
    #: thread make them (on a quiet filesystem a file costs less than waking a thread).
    _slow: bool = attrs.field(init=False, default=False, repr=False)

    def __repr__(self) -> str:
        return f"<FolderCache {len(self._entries)} open>"

    def open(
        self, directory: str, *, base: str | None = None, want: int | None = None
    ) -> tuple[LogFolder, int, list[Unnamed]]:
        """:meth:`LogFolder.make_opened` through the cache: the folder, a descriptor of it that the
        caller closes, and the unnamed files :meth:`prepare` made ahead in it, ``want`` of them at most
        (``None``: all; the caller's now; only when the folder passed its check: they are in the very
        folder it names).

        Raises:
            As :meth:`LogFolder.make_opened`.
        """
        key = (directory, base)
        entry = self._entries.pop(key, None)
        if entry is not None:
            checked = self._check(entry)
            if checked is not None:
                self._entries[key] = entry  # the most recently used last
                spare: list[Unnamed] = []
                if self._lock.acquire(blocking=False):  # busy: the thread is handing files over, no wait
                    cut = len(entry.spare) if want is None else want
                    spare, entry.spare = entry.spare[:cut], entry.spare[cut:]
                    self._lock.release()
                try:
                    return checked, os.dup(entry.fds[-1]), spare
                except BaseException:
                    for fd, _ in spare:
                        os.close(fd)
                    raise
            self._close_entry(entry)
        folder, fd = LogFolder.make_opened(directory, base=base)
        if not folder.made and not folder.wrote_ignores:  # nothing of this call's to undo: kept for the next
            try:
                self._keep(key, folder, fd)
            except OSError:
                pass  # not kept: the next create walks again
        return folder, fd, []

    def prepare(
        self, directory: str, *, base: str | None = None, make: Callable[[int], Unnamed], count: int
    ) -> None:
        """Make ``count`` unnamed files ahead in the cached folder (none when it is not cached), with
        ``make`` (given the folder's descriptor), for the next :meth:`open`. Called once a child is
        spawned, so that the next child's files are made while this one starts; a failure is ignored
        (the next create makes its own). A crash leaves nothing: the files have no name.

        With :attr:`background`, the files are made in the cache's thread and this returns at once (the
        files that are still being made when the next :meth:`open` comes serve the one after it).
        """
        entry = self._entries.get((directory, base))
        if entry is None or not entry.folder.parts:
            return
        if not (self.background and self._slow):
            self._make_into(entry.spare, count - entry.pending, make, entry.fds[-1])
            return
        if not self._lock.acquire(blocking=False):
            return  # the thread is handing files over: the next create makes its own if it must
        try:
            missing = count - len(entry.spare) - entry.pending
            if missing <= 0:
                return
            try:
                fd = os.dup(entry.fds[-1])  # the thread's own: valid whatever happens to the entry
            except OSError:
                return
            entry.pending += missing
            self._jobs.append((entry, fd, make, missing))
            self._lock.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="engine log files", daemon=True)
                self._thread.start()
        finally:
            self._lock.release()

    def _work(self) -> None:
        """The cache's thread: make the files each job asks for, and hand them to its entry (or close
        them, when the entry was closed meanwhile), until :meth:`close` (which makes it no longer the cache's
        thread: the jobs queued after are a new thread's)."""
        me = threading.current_thread()
        while True:
            with self._lock:
                while not self._jobs and self._thread is me:
                    self._lock.wait()
                if self._thread is not me:
                    return
                entry, fd, make, count = self._jobs.pop(0)
            made: list[Unnamed] = []
            try:
                self._make_into(made, count, make, fd)
            except Exception:
                _log.exception("making log files ahead in %s failed", entry.folder.path)
            finally:
                os.close(fd)
                with self._lock:
                    entry.pending -= count
                    if entry.closed:
                        for opened, _ in made:
                            os.close(opened)
                    else:
                        entry.spare.extend(made)

    def _make_into(
        self, made: list[Unnamed], count: int, make: Callable[[int], Unnamed], folder_fd: int
    ) -> None:
        """Make files with ``make`` in the folder ``folder_fd`` until ``made`` holds ``count`` (fewer when one
        fails: the next create makes its own), and note whether making one was slow: only then does the
        thread make them (fast again: the loop makes them itself, a thread's wake would cost more)."""
        before = len(made)
        started = time.perf_counter()
        try:
            while len(made) < count:
                made.append(make(folder_fd))
        except OSError:
            pass
        finally:
            if len(made) > before:
                self._slow = (time.perf_counter() - started) / (len(made) - before) > SLOW_FILE_SECONDS

    def _close_entry(self, entry: _Opened) -> None:
        with self._lock:
            entry.close()

    def _check(self, entry: _Opened) -> LogFolder | None:
        """The entry's folder when it is still where it was walked to (see the class), else ``None``."""
        folder = entry.folder
        try:
            if _identity(os.stat(folder.base)) != entry.identities[0]:
                return None
            steps = zip(entry.fds[:-1], folder.parts, entry.identities[1:], strict=True)
            for depth, (parent, name, identity) in enumerate(steps, start=1):
                info = os.stat(name, dir_fd=parent, follow_symlinks=False)
                if not stat.S_ISDIR(info.st_mode) or _identity(info) != identity:
                    return None
                if depth < len(folder.parts) and others_may_write(info.st_mode):
                    return None  # walked again: the walk refuses it (``.gadget`` made writable by others)
            if not folder.parts:
                return folder
            leaf = entry.fds[-1]
            if stat.S_IMODE(os.fstat(leaf).st_mode) != 0o700:
                os.fchmod(leaf, 0o700)
            seen = gitignore_seen(leaf)  # one lstat; touched since it was the engine's: looked at again
            if seen is None or seen != entry.ignore_seen:
                wrote = ensure_gitignore(leaf, folder.path)  # missing: written; not the engine's: replaced
                entry.ignore_seen = gitignore_seen(leaf)
                if wrote:  # undone with a failed create
                    return attrs.evolve(folder, wrote_ignores=(len(folder.parts),))
        except OSError:
            return None
        return folder

    def _keep(self, key: tuple[str, str | None], folder: LogFolder, fd: int) -> None:
        """Cache ``folder``: open its chain again from ``base`` (without following links) and check that
        the walk's end is the folder ``fd`` is."""
        fds = [os.open(folder.base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)]
        try:
            for name in folder.parts:
                fds.append(os.open(name, DIR_FLAGS, dir_fd=fds[-1]))
            identities = tuple(_identity(os.fstat(opened)) for opened in fds)
            if identities[-1] != _identity(os.fstat(fd)):
                raise FileNotFoundError(errno.ENOENT, "the log folder moved meanwhile", folder.path)
        except BaseException:
            for opened in fds:
                os.close(opened)
            raise
        self._entries[key] = _Opened(folder, tuple(fds), identities)
        while len(self._entries) > self.limit:
            oldest = next(iter(self._entries))
            self._close_entry(self._entries.pop(oldest))

    def release(self) -> None:
        """Close every cached folder's descriptors and the files made ahead, and drop the jobs queued, but
        keep the cache's thread, idle until the next job (the service, once no record has been left for a
        second: the next create walks its folder again). The thread's job under way ends with its files
        closed, never handed out (their entry is closed).

        The thread is kept because starting one per create and ending it per kill costs more than the
        thread's wait (nothing: it sleeps on a condition), and a process whose threads stay the same
        reads its own children through kept descriptors (``_own_children``), which a thread ending each
        time the last record went defeated.
        """
        with self._lock:
            self._drop_jobs()
            entries, self._entries = list(self._entries.values()), {}
            for entry in entries:
                entry.close()

    def close(self) -> None:
        """:meth:`release`, and end the cache's thread: wait for it (after the job it is on: a few file
        creations). The cache can be used again afterwards (a new thread then)."""
        with self._lock:
            thread, self._thread = self._thread, None  # no longer the cache's: it ends at its next look
            self._lock.notify_all()
        if thread is not None:
            thread.join()
        self.release()  # the jobs it left queued too

    def _drop_jobs(self) -> None:
        """Drop the jobs queued (the cache's lock held): their descriptors closed, their count no longer
        pending."""
        jobs, self._jobs = self._jobs, []
        for entry, fd, _, count in jobs:
            os.close(fd)
            entry.pending -= count
