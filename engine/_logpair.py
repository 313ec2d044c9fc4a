"""A child's pair of log files, from creation (before the spawn) to deletion.

Created before the spawn in a folder reached without following links (:class:`~engine._logdir.LogFolder`),
handed to the child as descriptors, given their final names (``subproc-<pid>.stdout.log`` /
``.stderr.log``) once the pid is known, capped while the child runs, read, and deleted by ``kill``. Each
file is a :class:`~engine._logs.LogFile`.

Until the pid is known the files have no name at all: they are made with ``O_TMPFILE`` in the folder's
checked descriptor and named with ``linkat`` of that very inode (``/proc/self/fd/<fd>``), so no other
file can be named in their place and a crash leaves nothing behind. Where the filesystem has no
``O_TMPFILE``, they are made under temporary names and renamed, as before.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import secrets
import stat
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from typing import final

import attrs

from ._folder_cache import FolderCache, Unnamed
from ._logdir import LogFolder, name_exists
from ._logs import STREAMS, LogFile, LogSlice, RawPiece, Stream, final_log_paths

__all__ = ["LogPair"]

_log = logging.getLogger("engine.subprocesses")

#: ``O_TMPFILE`` errors meaning "not on this filesystem" (old kernels report ``EISDIR``).
_NO_TMPFILE = frozenset({errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOTSUP})

_TMPFILE_FLAGS = os.O_TMPFILE | os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC

#: How many pairs of unnamed files :meth:`LogPair.prepare` keeps made ahead in a folder.
PAIRS_AHEAD = 2


def make_unnamed(folder_fd: int) -> tuple[int, tuple[int, int]]:
    """A new unnamed file in the folder ``folder_fd`` (``O_TMPFILE``, write-only, appending, close-on-exec,
    mode 0600 whatever the umask), that ``linkat`` can name later, and its ``(st_dev, st_ino)``.

    The mode is set again only when the umask took a bit of 0600 away (the ``fstat`` that gives the
    identity tells), not on every file.

    Raises:
        OSError: the filesystem has no ``O_TMPFILE`` (``EOPNOTSUPP``, ``EISDIR`` on old kernels), or the
            file cannot be made.
    """
    fd = os.open(".", _TMPFILE_FLAGS, 0o600, dir_fd=folder_fd)
    try:
        info = os.fstat(fd)
        if stat.S_IMODE(info.st_mode) != 0o600:
            os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd, (info.st_dev, info.st_ino)


def _make_file(folder: int, stream: Stream) -> tuple[str, tuple[int, int]]:
    """Create an empty log file (0600 whatever the umask) under a fresh temporary name in ``folder``."""
    while True:
        name = f".subproc-{secrets.token_hex(6)}.{stream}.log.tmp"
        try:
            fd = os.open(
                name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=folder
            )
        except FileExistsError:
            continue
        try:
            os.fchmod(fd, 0o600)
            info = os.fstat(fd)
        finally:
            os.close(fd)
        return name, (info.st_dev, info.st_ino)


@final
@attrs.define(eq=False)
class LogPair:
    """The two log files of one child, from creation (before the spawn) to deletion.

    Made by :meth:`create`. The files are created empty (mode 0600, in a folder of mode 0700 holding a
    ``.gitignore``) without names (or, without ``O_TMPFILE``, under temporary names), given to the child as
    its stdout and stderr (:meth:`open_for_child`), and named by :meth:`rename` once the pid is known;
    the child's descriptors follow.

    Attributes:
        directory: the folder holding both files.
    """

    directory: str
    _files: dict[Stream, LogFile] = attrs.field(alias="files")
    _folder: LogFolder = attrs.field(alias="folder")
    #: The unnamed files' descriptors (write-only, appending) and the folder's, until :meth:`rename`.
    _unnamed: dict[Stream, int] | None = attrs.field(alias="unnamed", default=None)
    _folder_fd: int = attrs.field(alias="folder_fd", default=-1)

    @classmethod
    def create(
        cls, directory: str, *, base: str | None = None, folders: FolderCache | None = None
    ) -> LogPair:
        """Create the folder (and its missing parents below ``base``) and two empty files, unnamed.

        The folders are reached from ``base`` without following links (see :class:`LogFolder`), made
        0700 when missing, and get a ``.gitignore`` holding ``*``: the log folder always, each folder
        made here too. On failure nothing is left: no file, no folder or ``.gitignore`` this call made.

        Args:
            directory: the log folder.
            base: the folder the walk starts from, opened as it is (the project directory; ``None``: the
                nearest existing folder above ``directory``).
            folders: the folders already walked (checked again, not walked again; see
                :class:`FolderCache`), or ``None`` to walk.

        Raises:
            UntrustedPathError: a folder on the way is a symbolic link or another user's.
            SpawnError: a file is in the way, or a folder cannot be made (reason ``"bad log folder"``).
            OSError: a file cannot be created.
        """
        spare: list[Unnamed] = []
        if folders is not None:
            folder, fd, spare = folders.open(directory, base=base, want=len(STREAMS))
        else:
            folder, fd = LogFolder.make_opened(directory, base=base)
        unnamed: list[int] = [opened for opened, _ in spare]
        identities: list[tuple[int, int]] = [identity for _, identity in spare]
        try:
            while len(unnamed) < len(STREAMS):
                opened, identity = make_unnamed(fd)
                unnamed.append(opened)
                identities.append(identity)
        except OSError as exc:
            for opened in unnamed:
                os.close(opened)
            if exc.errno not in _NO_TMPFILE:
                os.close(fd)
                folder.unmake()
                raise
            return cls._create_named(folder, fd)
        except BaseException:
            for opened in unnamed:
                os.close(opened)
            os.close(fd)
            folder.unmake()
            raise
        files = {}
        for stream, identity in zip(STREAMS, identities, strict=True):
            placeholder = os.path.join(folder.path, f"(unnamed {stream} log, named once the pid is known)")
            files[stream] = LogFile(placeholder, folder=folder, identity=identity)
        return cls(
            directory=folder.path,
            files=files,
            folder=folder,
            unnamed=dict(zip(STREAMS, unnamed, strict=True)),
            folder_fd=fd,
        )

    @classmethod
    def _create_named(cls, folder: LogFolder, fd: int) -> LogPair:
        """Without ``O_TMPFILE``: two empty files under fresh temporary names, renamed later."""
        made: list[tuple[str, tuple[int, int]]] = []
        try:
            for stream in STREAMS:
                made.append(_make_file(fd, stream))
        except BaseException:
            with contextlib.suppress(OSError):
                for name, _ in made:
                    os.unlink(name, dir_fd=fd)
            folder.unmake()
            raise
        finally:
            os.close(fd)
        files = {
            stream: LogFile(os.path.join(folder.path, name), folder=folder, identity=identity)
            for stream, (name, identity) in zip(STREAMS, made, strict=True)
        }
        return cls(directory=folder.path, files=files, folder=folder)

    @staticmethod
    def prepare(directory: str, *, base: str | None = None, folders: FolderCache) -> None:
        """Make the next pairs' files ahead, unnamed, in the cached folder (see
        :meth:`FolderCache.prepare`): called right after a spawn, while the child starts.

        Two pairs are kept ahead (:data:`PAIRS_AHEAD`): where the cache's thread makes them (a slow
        filesystem), the next create takes the pair made during the last one while the thread makes the
        one after, instead of making its own on the loop when the thread has not finished yet.
        """
        folders.prepare(directory, base=base, make=make_unnamed, count=PAIRS_AHEAD * len(STREAMS))

    def path(self, stream: Stream) -> str:
        """Where the ``stream`` file is now."""
        return self._files[stream].path

    @property
    def paths(self) -> tuple[str, str]:
        """``(stdout path, stderr path)``, where they are now."""
        return self._files["stdout"].path, self._files["stderr"].path

    @contextlib.contextmanager
    def open_for_child(self) -> Iterator[tuple[int, int]]:
        """``(stdout fd, stderr fd)`` for a child: the two files opened ``O_WRONLY | O_APPEND`` (the
        unnamed files' own descriptors, kept until :meth:`rename`; named files opened without following a
        link and closed when the block is left). The child keeps its copies.

        Raises:
            FileNotFoundError: a file is gone or is not the one made by :meth:`create`.
        """
        if self._unnamed is not None:
            yield self._unnamed["stdout"], self._unnamed["stderr"]
            return
        with (
            self._files["stdout"].opened(os.O_WRONLY | os.O_APPEND) as out,
            self._files["stderr"].opened(os.O_WRONLY | os.O_APPEND) as err,
        ):
            yield out, err

    def rename(self, pid: int, others: Iterable[LogPair] = ()) -> None:
        """Give both files their final names, ``subproc-<pid>.stdout.log`` / ``.stderr.log``.

        Files already holding those names (a kept record of an earlier child that had the same pid)
        move aside first, to ``subproc-<pid>-<n>.*`` with the first free ``n``; the pair among
        ``others`` that owns them follows them. Every rename is made in the folder's descriptor, so a
        link is renamed as a link, never followed; an unnamed file is named by ``linkat`` of its own
        inode, which never replaces a name that exists.

        Raises:
            OSError: a rename (or naming) failed; each file is where its path says.
        """
        finals = [os.path.basename(p) for p in final_log_paths(self.directory, pid)]
        if self._unnamed is not None:
            # Named first, moved aside only when a name is taken: ``linkat`` never replaces a name, so a
            # fresh pid's names (the usual case) cost no look beforehand.
            for attempt in range(4):
                try:
                    self._link_unnamed(finals)
                except FileExistsError:
                    if attempt == 3:
                        raise
                    self._move_aside(self._folder_fd, pid, finals, others)
                    continue  # moved aside (or a file took a final name meanwhile): name again
                break
            self._close_unnamed()
            return
        with self._folder.opened() as fd:
            self._move_aside(fd, pid, finals, others)
            for stream, name in zip(STREAMS, finals, strict=True):
                log = self._files[stream]
                os.rename(os.path.basename(log.path), name, src_dir_fd=fd, dst_dir_fd=fd)
                log.path = os.path.join(self.directory, name)

    def _move_aside(self, fd: int, pid: int, finals: list[str], others: Iterable[LogPair]) -> None:
        """Move files holding the final names aside (an earlier child's, kept), with their owner."""
        if not any(name_exists(fd, name) for name in finals):
            return
        generation = 1
        while any(
            name_exists(fd, os.path.basename(p)) for p in final_log_paths(self.directory, pid, generation)
        ):
            generation += 1
        aside = final_log_paths(self.directory, pid, generation)
        owners = {log.path: log for pair in others for log in pair._files.values()}
        for old, new in zip(finals, aside, strict=True):
            old_path = os.path.join(self.directory, old)
            if name_exists(fd, old):
                os.rename(old, os.path.basename(new), src_dir_fd=fd, dst_dir_fd=fd)
            if old_path in owners:
                owners[old_path].path = new

    def _link_unnamed(self, finals: list[str]) -> None:
        """Name both unnamed files, all or nothing."""
        assert self._unnamed is not None
        linked: list[Stream] = []
        try:
            for stream, name in zip(STREAMS, finals, strict=True):
                os.link(f"/proc/self/fd/{self._unnamed[stream]}", name, dst_dir_fd=self._folder_fd)
                linked.append(stream)
        except BaseException:
            for stream in linked:  # only a name that is still our inode's
                name = finals[STREAMS.index(stream)]
                with contextlib.suppress(OSError):
                    info = os.stat(name, dir_fd=self._folder_fd, follow_symlinks=False)
                    if (info.st_dev, info.st_ino) == self._files[stream].identity:
                        os.unlink(name, dir_fd=self._folder_fd)
            raise
        for stream, name in zip(STREAMS, finals, strict=True):
            self._files[stream].path = os.path.join(self.directory, name)

    def _close_unnamed(self) -> None:
        if self._unnamed is not None:
            for fd in self._unnamed.values():
                os.close(fd)
            self._unnamed = None
        if self._folder_fd >= 0:
            os.close(self._folder_fd)
            self._folder_fd = -1

    @property
    def files(self) -> tuple[LogFile, LogFile]:
        """``(stdout file, stderr file)``."""
        return self._files["stdout"], self._files["stderr"]

    def enforce_cap(
        self,
        cap_bytes: int,
        *,
        only: Iterable[LogFile] | None = None,
        arm: Callable[[LogFile, int], object] | None = None,
    ) -> int:
        """Keep each file within about ``cap_bytes`` (see :meth:`LogFile.enforce_cap`); a file that
        fails is logged and left as it is. Returns the bytes dropped.

        Args:
            cap_bytes: the size to keep.
            only: these of the pair's files (``None``: both).
            arm: called with each file and its checked descriptor before its size is read (the log
                cap's watch, ``_logwatch``).
        """
        dropped = 0
        for log in self._files.values() if only is None else only:
            try:
                dropped += log.enforce_cap(
                    cap_bytes, arm=None if arm is None else functools.partial(arm, log)
                )
            except OSError as exc:
                _log.warning("log cap of %s failed: %s", log.path, exc)
        return dropped

    def read(
        self,
        stream: Stream,
        *,
        offset: int | None = None,
        limit: int | None = None,
        tail: int | None = None,
        max_bytes: int | None = None,
    ) -> LogSlice:
        """A slice of the ``stream`` file (see :meth:`LogFile.read`); every kept byte by default.

        Raises:
            FileNotFoundError: the file is gone, or is not the one the engine made.
        """
        return self._files[stream].read(offset=offset, limit=limit, tail=tail, max_bytes=max_bytes)

    def read_raw(self, stream: Stream, offset: int | None, max_bytes: int) -> RawPiece:
        """Undecoded bytes of the ``stream`` file (see :meth:`LogFile.read_raw`).

        Raises:
            FileNotFoundError: the file is gone, or is not the one the engine made.
        """
        return self._files[stream].read_raw(offset, max_bytes)

    def append_line(self, text: str) -> None:
        """Append ``text`` and a newline to both files (the restart marker lines); a file that is gone, or
        is not the one the engine made, is skipped."""
        data = (text + "\n").encode()
        for log in self._files.values():
            try:
                with log.opened(os.O_WRONLY | os.O_APPEND) as fd:
                    os.write(fd, data)
            except OSError as exc:
                _log.warning("cannot write a marker line to %s: %s", log.path, exc)

    def modified_at(self) -> datetime | None:
        """The later modification time of the two files (aware UTC), or ``None`` when both are gone."""
        times = [info.st_mtime for info in (log.stat() for log in self._files.values()) if info is not None]
        return datetime.fromtimestamp(max(times), UTC) if times else None

    def delete(self) -> None:
        """Delete both files (missing is fine); the folder stays.

        Only the files the engine made are deleted, and a link, FIFO or socket a child put in their place
        (a directory entry of the engine's own folder; nothing it points to is touched). Another regular
        file at a log's path is left alone. Files never named are freed with their descriptors.
        """
        if self._unnamed is not None:  # never named: closing frees them
            self._close_unnamed()
            return
        try:
            with self._folder.opened() as fd:
                for log in self._files.values():
                    name = os.path.basename(log.path)
                    try:
                        info = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    ours = (info.st_dev, info.st_ino) == log.identity
                    if ours or not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            pass  # the folder is gone (or is not ours any more): nothing of ours to delete

    def discard(self) -> None:
        """Undo :meth:`create`: delete both files, and the folders and ``.gitignore`` files it made
        when they are empty."""
        self.delete()
        self._folder.unmake()
