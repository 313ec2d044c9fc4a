"""The folder of a project's log files, reached without following a link: ``.gadget/subprocess-logs``.

A project is often a cloned repository, and what is in it is not the engine's to trust: a ``.gadget``
committed as a symbolic link would send the engine's ``chmod`` and its files elsewhere. So the folder is
reached the way ``openat`` allows: the project directory is opened, then each folder below it with
``O_NOFOLLOW | O_DIRECTORY`` from its parent's descriptor, and each must be a real directory owned by the
engine's uid. A missing folder is made (mode 0700 whatever the umask). A link, a file in the way or a
folder of another owner is an error that names it.

The folder is remembered by its device and inode: a later open (to read a log, cap it, delete it) that
finds another folder at the same path (replaced, moved, a link put there) treats the logs as gone.

Project hygiene: logs may hold secrets a process printed, so they must never show in ``git status``. The
engine writes a ``.gitignore`` holding ``*`` in the log folder (always) and in each folder it made itself
(``.gadget`` when the project had none).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from typing import Final, final

import attrs

from ._errors import SpawnError, UntrustedPathError
from ._trust import what_it_is

__all__ = ["GITIGNORE", "FolderCache", "LogFolder", "LogGoneError", "Unnamed"]

#: The name of the file that keeps a folder out of git.
GITIGNORE: Final = ".gitignore"
_IGNORE_ALL: Final = b"# written by gadget-engine: logs may hold secrets\n*\n"
_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

_log = logging.getLogger("engine.subprocesses")

#: A file made ahead that took longer than this (wall time) has the next ones made by the cache's thread.
SLOW_FILE_SECONDS: Final = 20e-6


class LogGoneError(FileNotFoundError):
    """Raised when a log file, or its folder, is no longer the one the engine made (replaced, moved, a
    link or a FIFO put in its place): for the engine the log is gone, whatever is at its path now."""


def _parts(base: str, directory: str) -> tuple[str, ...]:
    relative = os.path.relpath(directory, base)
    parts = tuple(p for p in relative.split(os.sep) if p not in ("", "."))
    if any(p == ".." for p in parts):
        raise ValueError(f"the log folder {directory!r} is not under {base!r}")
    return parts


def _nearest_existing(path: str) -> str:
    probe = path
    while not os.path.isdir(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    return probe


def _explain(parent_fd: int, name: str, where: str, exc: OSError) -> OSError:
    """The error to raise when ``name`` (at ``where``) could not be opened as a folder."""
    if exc.errno in (errno.ENOTDIR, errno.ELOOP):
        try:
            info = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        except OSError:
            info = None
        if info is not None and stat.S_ISLNK(info.st_mode):
            return UntrustedPathError(
                f"{where} is a symbolic link; the engine does not follow links under a project (a cloned "
                "repository may hold one): replace it with a real folder, or remove it"
            )
        what = "a file" if info is None or stat.S_ISREG(info.st_mode) else what_it_is(info.st_mode)
        return SpawnError(
            f"cannot make the log folder: {where} is {what}, not a folder; rename or remove it",
            errno=errno.ENOTDIR,
            path=where,
            reason="bad log folder",
        )
    return SpawnError(
        f"cannot make the log folder {where}: {exc.strerror or exc}",
        errno=exc.errno,
        path=where,
        reason="bad log folder",
    )


def _check_owner(fd: int, where: str) -> None:
    owner, euid = os.fstat(fd).st_uid, os.geteuid()
    if owner != euid:
        raise UntrustedPathError(
            f"the log folder {where} is owned by uid {owner}, not by this engine's uid {euid}; "
            "the engine writes logs only into folders of its own user: remove it or change its owner"
        )


def _exists(fd: int, name: str) -> bool:
    """Whether anything (a link too, not followed) is at ``name`` in the folder ``fd``: one ``lstat``,
    cheaper than an ``O_EXCL`` open that fails."""
    try:
        os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _write_gitignore(fd: int) -> bool:
    """Write ``.gitignore`` (``*``) in the folder ``fd`` unless one is there; whether this call wrote it."""
    try:
        file = os.open(
            GITIGNORE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=fd
        )
    except FileExistsError:
        return False
    try:
        os.write(file, _IGNORE_ALL)
    finally:
        os.close(file)
    return True


@final
@attrs.frozen
class LogFolder:
    """A log folder as the engine made (or found) it, reached from ``base`` without following links.

    Attributes:
        path: the folder's absolute path (for messages and the paths shown to users).
        base: the folder the walk starts from (the project directory), opened as it is.
        parts: the names of the folders from ``base`` down to the log folder.
        identity: the log folder's ``(st_dev, st_ino)``.
        made: how many of ``parts``, counted from the end, this engine made.
        wrote_ignores: the depths (1 = ``parts[0]``) whose ``.gitignore`` this engine wrote.
    """

    path: str
    base: str
    parts: tuple[str, ...]
    identity: tuple[int, int]
    made: int = 0
    wrote_ignores: tuple[int, ...] = ()

    @classmethod
    def make(cls, directory: str, *, base: str | None = None) -> LogFolder:
        """Open (making what is missing, 0700) the folder ``directory`` below ``base``.

        Args:
            directory: the log folder's absolute path.
            base: where the walk starts, opened as it is (``None``: the nearest existing folder above
                ``directory``).

        Raises:
            UntrustedPathError: a folder on the way is a symbolic link or owned by another uid.
            SpawnError: a file is in the way, or a folder cannot be made (reason ``"bad log folder"``).
        """
        folder, fd = cls.make_opened(directory, base=base)
        os.close(fd)
        return folder

    @classmethod
    def make_opened(cls, directory: str, *, base: str | None = None) -> tuple[LogFolder, int]:
        """:meth:`make`, and the checked descriptor of the folder the walk ended on (the caller closes
        it), so that files can be made in it without walking again.

        Raises:
            As :meth:`make`.
        """
        directory = os.path.abspath(directory)
        base = os.path.abspath(base) if base is not None else _nearest_existing(directory)
        parts = _parts(base, directory)
        made = 0
        wrote: list[int] = []
        reached = 0
        fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for depth, name in enumerate(parts, start=1):
                where = os.path.join(base, *parts[:depth])
                child, created = cls._open_or_make(fd, name, where)
                os.close(fd)
                fd, reached = child, depth
                if created:  # once one is missing, so is every folder below it: the made ones are the last
                    made += 1
                    os.fchmod(fd, 0o700)  # mkdir's mode is filtered by the umask
                    if _write_gitignore(fd):
                        wrote.append(depth)
                _check_owner(fd, where)
            if parts:
                os.fchmod(fd, 0o700)
                if _write_gitignore(fd) and len(parts) not in wrote:
                    wrote.append(len(parts))
            info = os.fstat(fd)
        except BaseException:
            try:
                if made or wrote:  # leave nothing of this call: what it wrote, the folders it made
                    info = os.fstat(fd)
                    partial = parts[:reached]
                    identity = (info.st_dev, info.st_ino)
                    path = os.path.join(base, *partial)
                    cls(path, base, partial, identity, made, tuple(wrote)).unmake()
            finally:
                os.close(fd)
            raise
        return cls(directory, base, parts, (info.st_dev, info.st_ino), made, tuple(wrote)), fd

    @staticmethod
    def _open_or_make(parent: int, name: str, where: str) -> tuple[int, bool]:
        created = False
        for _ in range(3):
            try:
                return os.open(name, _DIR_FLAGS, dir_fd=parent), created
            except FileNotFoundError:
                try:
                    os.mkdir(name, 0o700, dir_fd=parent)
                    created = True
                except FileExistsError:
                    continue  # made meanwhile: open it
                except OSError as exc:
                    raise _explain(parent, name, where, exc) from None
            except OSError as exc:
                raise _explain(parent, name, where, exc) from None
        raise SpawnError(f"cannot make the log folder {where}", path=where, reason="bad log folder")

    @contextlib.contextmanager
    def opened(self, depth: int | None = None) -> Iterator[int]:
        """A descriptor of the log folder (or of the folder at ``depth`` on the way), checked again.

        Raises:
            LogGoneError: a folder on the way is gone, is a link now, or the log folder is
                another one than the engine made.
        """
        fd = self.open(depth)
        try:
            yield fd
        finally:
            os.close(fd)

    def open(self, depth: int | None = None) -> int:
        """:meth:`opened` for a descriptor the caller keeps (and closes).

        Raises:
            LogGoneError: as :meth:`opened`.
        """
        depth = len(self.parts) if depth is None else depth
        fd = os.open(self.base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for name in self.parts[:depth]:
                try:
                    child = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except OSError:
                    raise LogGoneError(
                        errno.ENOENT, "the log folder is gone or was replaced", self.path
                    ) from None
                os.close(fd)
                fd = child
            if depth == len(self.parts):
                info = os.fstat(fd)
                if (info.st_dev, info.st_ino) != self.identity:
                    raise LogGoneError(errno.ENOENT, "the log folder was replaced", self.path)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def unmake(self) -> None:
        """Undo :meth:`make`: remove the ``.gitignore`` files it wrote and the folders it made, when
        they are empty (innermost first); anything else stays."""
        depths = sorted({*self.wrote_ignores, *range(len(self.parts) - self.made + 1, len(self.parts) + 1)})
        for depth in reversed(depths):
            try:
                if depth in self.wrote_ignores:
                    with self.opened(depth) as fd:
                        os.unlink(GITIGNORE, dir_fd=fd)
                if depth > len(self.parts) - self.made:
                    with self.opened(depth - 1) as parent:
                        os.rmdir(self.parts[depth - 1], dir_fd=parent)
            except OSError:
                return


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
            for parent, name, identity in steps:
                info = os.stat(name, dir_fd=parent, follow_symlinks=False)
                if not stat.S_ISDIR(info.st_mode) or _identity(info) != identity:
                    return None
            if not folder.parts:
                return folder
            leaf = entry.fds[-1]
            if stat.S_IMODE(os.fstat(leaf).st_mode) != 0o700:
                os.fchmod(leaf, 0o700)
            if not _exists(leaf, GITIGNORE) and _write_gitignore(leaf):  # removed since: written again,
                return attrs.evolve(folder, wrote_ignores=(len(folder.parts),))  # undone with a failed create
        except OSError:
            return None
        return folder

    def _keep(self, key: tuple[str, str | None], folder: LogFolder, fd: int) -> None:
        """Cache ``folder``: open its chain again from ``base`` (without following links) and check that
        the walk's end is the folder ``fd`` is."""
        fds = [os.open(folder.base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)]
        try:
            for name in folder.parts:
                fds.append(os.open(name, _DIR_FLAGS, dir_fd=fds[-1]))
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

    def close(self, *, wait: bool = True) -> None:
        """Close every cached folder's descriptors and the files made ahead; end the cache's thread
        (after the job it is on: a few file creations). The cache can be used again afterwards.

        Args:
            wait: wait for the thread to end. Without, it ends on its own once done with its job (the
                files it made then are closed, never handed out: their entry is closed); ``kill_all``
                does not wait for a thread's wake-up (a few ms on a loaded machine) it has no use for.
        """
        with self._lock:
            jobs, self._jobs = self._jobs, []
            thread, self._thread = self._thread, None
            for entry, fd, _, count in jobs:
                os.close(fd)
                entry.pending -= count
            self._lock.notify_all()
        if thread is not None and wait:
            thread.join()
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
            for entry in entries:
                entry.close()
