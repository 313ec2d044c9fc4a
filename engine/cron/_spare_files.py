"""Spare files: the inodes of spent exit records kept, emptied, for the next watched commands' logs.

On an ext4 without a journal, the kernel does not hand out again an inode freed less than 60 s ago, or
less than 360 s ago while the inode table block holding it is not written back (``recently_deleted`` in
the kernel's ``fs/ext4/ialloc.c``): each new file of the block group skips every such inode first. 100
on-exit commands whose exit records are removed when their jobs fire or are cancelled make each of the
next arms' logs cost 0.5 ms instead of 20 us (``docs/benchmarks/analysis.md``, twenty-second round).

So a spent exit record is not unlinked: :meth:`SpareFiles.retire` empties it (``ftruncate``) and moves
it into ``watch-logs/.spare/``, and :func:`~engine.cron._log_files.open_logs` takes one from there for a
new log (:meth:`SpareFiles.take`: a ``rename`` onto the log's name, which replaces whatever a command
put there without following it) before it makes a new file. An exit record is spent once its watch ends:
its shim wrote it to a temporary file, closed it and renamed it into place, so no process of the engine's
holds it. At most :attr:`SpareFiles.limit` are kept; past that a record is unlinked as before. A spare is
checked when it is taken, as any file of the state directory is (a command runs as the engine's user and
may put anything in ``.spare/``): a regular file of the engine's user (looked at before it is opened: a
device is never opened), opened without following a link or waiting on a FIFO, with no other name (a hard
link to another file is never truncated nor written), and given the mode a new log has (0600: the shim's
record was made under the engine's umask).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import threading
from typing import Final, final

import attrs

from .._trust import open_own_folder

__all__ = ["SPARE_FOLDER", "SpareFiles"]

#: The folder of the spare files, in ``watch-logs/``.
SPARE_FOLDER: Final = ".spare"
#: A log's mode, as a new one is made (``open_logs``), whatever mode the spent record had.
_MODE: Final = 0o600
#: What :meth:`SpareFiles._take_one` gives for a spare that is not one (never a descriptor).
_UNUSABLE: Final = -1


@final
@attrs.define(eq=False)
class SpareFiles:
    """The spare files of one ``watch-logs/`` folder (see the module). Thread-safe; blocking calls.

    Attributes:
        folder: the ``watch-logs/`` folder.
        limit: how many spare files are kept at most.
    """

    folder: str
    limit: int = 256
    #: The spares' names in ``.spare/``; ``None`` until the folder is first listed.
    _names: list[str] | None = attrs.field(init=False, default=None)
    _made: int = attrs.field(init=False, default=0)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock, repr=False)

    def __repr__(self) -> str:
        return f"<SpareFiles {self.folder} {len(self._names or ())} spare>"

    def retire(self, path: str) -> bool:
        """Keep the spent file at ``path`` (in :attr:`folder`) as a spare: emptied, moved into ``.spare/``.

        Returns:
            Whether it was kept (then nothing is left at ``path``). ``False``: nothing there, not a
            regular file of this user with one name, the spares are :attr:`limit` already, or a step
            failed; the caller removes what is there as before.
        """
        with self._lock:
            names = self._listed()
            if len(names) >= self.limit:
                return False
            name = f"s{self._made}"
            self._made += 1
        opened = _open_lone_file(path, os.O_WRONLY, None)
        if opened is None:
            return False
        fd, info = opened
        try:
            spare_fd = self._spare_folder(make=True)
            try:
                os.ftruncate(fd, 0)
                os.rename(path, name, dst_dir_fd=spare_fd)
                if _identity_at(spare_fd, name) != (info.st_dev, info.st_ino):
                    with contextlib.suppress(OSError):  # swapped for something else meanwhile: not a spare
                        os.unlink(name, dir_fd=spare_fd)
                    return True
            finally:
                os.close(spare_fd)
        except OSError:
            return False
        finally:
            os.close(fd)
        with self._lock:
            self._listed().append(name)
        return True

    def take(self, name: str, folder_fd: int, flags: int) -> int | None:
        """A spare, named ``name`` in the folder ``folder_fd`` (:attr:`folder`, opened) and opened with
        ``flags`` (no ``O_CREAT``), empty; ``None`` when there is no usable spare (the caller makes a new
        file). Whatever was at ``name`` is replaced, never followed (a directory there: ``None``)."""
        while True:
            with self._lock:
                names = self._listed()
                if not names:
                    return None
                spare = names.pop()
            try:
                spare_fd = self._spare_folder(make=False)
            except OSError:
                return None
            try:
                fd = self._take_one(spare, spare_fd, name, folder_fd, flags)
            finally:
                os.close(spare_fd)
            if fd != _UNUSABLE:
                return fd

    def _take_one(self, spare: str, spare_fd: int, name: str, folder_fd: int, flags: int) -> int | None:
        """Open the spare ``spare`` and rename it to ``name``: its descriptor; :data:`_UNUSABLE` when it is
        not a spare to use (it is removed; the next is tried), ``None`` when a step failed (it stays a
        spare; none is tried: a folder at ``name`` fails each alike)."""
        opened = _open_lone_file(spare, flags, spare_fd)
        if opened is None:
            _remove(spare, spare_fd)
            return _UNUSABLE
        fd, info = opened
        try:
            if info.st_size:
                os.ftruncate(fd, 0)
            if stat.S_IMODE(info.st_mode) != _MODE:  # a log is 0600, whatever made the record (a umask)
                os.fchmod(fd, _MODE)
            os.rename(spare, name, src_dir_fd=spare_fd, dst_dir_fd=folder_fd)
            os.set_blocking(fd, True)
        except OSError:
            os.close(fd)
            with self._lock:
                self._listed().append(spare)
            return None
        return fd

    def _listed(self) -> list[str]:
        """The spares' names, ``.spare/`` listed once first (under the lock)."""
        if self._names is None:
            try:
                self._names = os.listdir(os.path.join(self.folder, SPARE_FOLDER))
            except OSError:
                self._names = []
            numbers = [int(n[1:]) for n in self._names if n.startswith("s") and n[1:].isdigit()]
            self._made = max(numbers, default=-1) + 1
        return self._names

    def _spare_folder(self, *, make: bool) -> int:
        """``.spare/``, opened and checked a folder of ours (made first, 0700, when ``make``)."""
        path = os.path.join(self.folder, SPARE_FOLDER)
        try:
            return open_own_folder(path, "the spare files")
        except FileNotFoundError:
            if not make:
                raise
            os.mkdir(path, 0o700)
            return open_own_folder(path, "the spare files")


def _open_lone_file(name: str, flags: int, dir_fd: int | None) -> tuple[int, os.stat_result] | None:
    """``name`` (in ``dir_fd``) opened with ``flags``, and its ``fstat``, when it is a regular file of
    ours with one name: looked at (``lstat``) before it is opened, so that a device is never opened;
    opened without following a link or waiting on a FIFO (``O_NONBLOCK``: the caller clears it); the
    same inode after the open. ``None`` otherwise (nothing is left open)."""
    try:
        seen = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not _lone_file_of_ours(seen):
            return None
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if _lone_file_of_ours(info) and (info.st_dev, info.st_ino) == (seen.st_dev, seen.st_ino):
            return fd, info
    except OSError:
        pass
    os.close(fd)
    return None


def _lone_file_of_ours(info: os.stat_result) -> bool:
    """Whether ``info`` is a regular file of this process's user with no other name."""
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and info.st_nlink == 1


def _identity_at(folder_fd: int, name: str) -> tuple[int, int] | None:
    try:
        info = os.stat(name, dir_fd=folder_fd, follow_symlinks=False)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _remove(name: str, folder_fd: int) -> None:
    """Remove an unusable spare (a folder a command made there too, with what is in it, following no
    link: ``shutil.rmtree`` in the folder's descriptor)."""
    try:
        os.unlink(name, dir_fd=folder_fd)
    except IsADirectoryError:
        shutil.rmtree(name, dir_fd=folder_fd, ignore_errors=True)
    except OSError:
        pass
