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
(``.gadget`` when the project had none). The log folder's is the engine's alone: one that is there but does
not ignore everything (a repository's own ``.gitignore`` committed in that folder, a link to another file)
is replaced, so a repository cannot put the logs back into ``git status``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
from collections.abc import Iterator
from typing import Final, final

import attrs

from ._errors import SpawnError, UntrustedPathError
from ._trust import what_it_is

__all__ = [
    "DIR_FLAGS",
    "GITIGNORE",
    "LogFolder",
    "LogGoneError",
    "ensure_gitignore",
    "gitignore_seen",
    "name_exists",
    "others_may_write",
    "write_gitignore",
]

_log = logging.getLogger("engine.subprocesses")

#: The name of the file that keeps a folder out of git.
GITIGNORE: Final = ".gitignore"
_IGNORE_ALL: Final = b"# written by gadget-engine: logs may hold secrets\n*\n"
DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


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


def others_may_write(mode: int) -> bool:
    """Whether group or others may write in a folder of ``mode`` (``st_mode``) that is not sticky."""
    return bool(stat.S_IMODE(mode) & 0o022) and not mode & stat.S_ISVTX


def _check_owner(fd: int, where: str, *, on_the_way: bool) -> None:
    """The folder ``fd`` (at ``where``) must be the engine's user's; one ``on_the_way`` to the log folder
    (``.gadget``) must also not be writable by other users unless it is sticky (as ``/tmp``): in it, they
    could move the log folder away, and the logs out of the engine's reach (its ``kill`` then cannot
    delete them). The log folder itself is made 0700 by the caller.

    Raises:
        UntrustedPathError: another user owns it, or others may write in it.
    """
    info = os.fstat(fd)
    owner, euid = info.st_uid, os.geteuid()
    if owner != euid:
        raise UntrustedPathError(
            f"the log folder {where} is owned by uid {owner}, not by this engine's uid {euid}; "
            "the engine writes logs only into folders of its own user: remove it or change its owner"
        )
    if on_the_way and others_may_write(info.st_mode):
        raise UntrustedPathError(
            f"the folder {where} can be written by other users (mode {stat.S_IMODE(info.st_mode):04o}): "
            f"they could move the logs out of the engine's reach; run `chmod go-w {where}`"
        )


def name_exists(fd: int, name: str) -> bool:
    """Whether anything (a link too, not followed) is at ``name`` in the folder ``fd``: one ``lstat``,
    cheaper than an ``O_EXCL`` open that fails."""
    try:
        os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def write_gitignore(fd: int) -> bool:
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


def gitignore_seen(fd: int) -> tuple[int, int, int, int] | None:
    """What one ``lstat`` tells of the folder ``fd``'s ``.gitignore`` (inode, size, mode, change time in
    ns), or ``None`` when there is none: the same answer as at the last :func:`ensure_gitignore` means the
    file was not touched since."""
    try:
        info = os.stat(GITIGNORE, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return info.st_ino, info.st_size, info.st_mode, info.st_ctime_ns


def _ignores_all(fd: int) -> bool:
    """Whether the folder ``fd``'s ``.gitignore`` is a regular file of the engine's uid holding exactly
    what :func:`write_gitignore` writes (read without following a link, without blocking on a FIFO)."""
    try:
        file = os.open(GITIGNORE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
    except OSError:
        return False
    try:
        info = os.fstat(file)
        if (
            not stat.S_ISREG(info.st_mode)
            or info.st_uid != os.geteuid()
            or info.st_nlink != 1  # a hard link: its other name could change it behind the engine's back
            or info.st_size != len(_IGNORE_ALL)
        ):
            return False
        return os.read(file, len(_IGNORE_ALL) + 1) == _IGNORE_ALL
    finally:
        os.close(file)


def ensure_gitignore(fd: int, where: str) -> bool:
    """Make the folder ``fd`` (at ``where``) hold the engine's ``.gitignore`` (``*``): written when there
    is none, replaced (by a rename in the folder, which never follows a link) when the one there is not
    exactly the engine's, with a warning in the engine's log. Returns whether this call wrote a missing
    one (what a failed create undoes; a replaced file stays replaced).

    Raises:
        SpawnError: ``.gitignore`` is a folder, or cannot be replaced (reason ``"bad log folder"``).
    """
    if write_gitignore(fd):
        return True
    if _ignores_all(fd):
        return False
    path = os.path.join(where, GITIGNORE)
    temporary = f".gitignore.{secrets.token_hex(6)}.tmp"
    try:
        file = os.open(
            temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=fd
        )
        try:
            os.write(file, _IGNORE_ALL)
        finally:
            os.close(file)
        os.rename(temporary, GITIGNORE, src_dir_fd=fd, dst_dir_fd=fd)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(temporary, dir_fd=fd)
        raise SpawnError(
            f"cannot make the log folder's {path} ignore the logs (they may hold secrets): "
            f"{exc.strerror or exc}; rename or remove it",
            errno=exc.errno,
            path=path,
            reason="bad log folder",
        ) from None
    _log.warning(
        "event=gitignore_replaced path=%s: it did not ignore everything, and the logs may hold secrets",
        path,
    )
    return False


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
                    if write_gitignore(fd):
                        wrote.append(depth)
                _check_owner(fd, where, on_the_way=depth < len(parts))
            if parts:
                os.fchmod(fd, 0o700)
                if ensure_gitignore(fd, directory) and len(parts) not in wrote:
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
                return os.open(name, DIR_FLAGS, dir_fd=parent), created
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
                    child = os.open(name, DIR_FLAGS, dir_fd=fd)
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
