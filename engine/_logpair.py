"""A child's pair of log files, from creation (before the spawn) to deletion.

Created under temporary names before the spawn in a folder reached without following links
(:class:`~engine._logdir.LogFolder`), handed to the child as descriptors, given their final names
(``subproc-<pid>.stdout.log`` / ``.stderr.log``) once the pid is known, capped while the child runs, read,
and deleted by ``kill``. Each file is a :class:`~engine._logs.LogFile`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import stat
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from typing import final

import attrs

from ._logdir import LogFolder
from ._logs import STREAMS, LogFile, LogSlice, Stream, final_log_paths

__all__ = ["LogPair"]

_log = logging.getLogger("engine.subprocesses")


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


def _exists(folder: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


@final
@attrs.define(eq=False)
class LogPair:
    """The two log files of one child, from creation (before the spawn) to deletion.

    Made by :meth:`create`. The files are created empty (mode 0600, in a folder of mode 0700 holding a
    ``.gitignore``) under temporary names, given to the child as its stdout and stderr
    (:meth:`open_for_child`), and renamed to their final names by :meth:`rename` once the pid is known;
    the child's descriptors follow a rename.

    Attributes:
        directory: the folder holding both files.
    """

    directory: str
    _files: dict[Stream, LogFile] = attrs.field(alias="files")
    _folder: LogFolder = attrs.field(alias="folder")

    @classmethod
    def create(cls, directory: str, *, base: str | None = None) -> LogPair:
        """Create the folder (and its missing parents below ``base``) and two empty files under
        temporary names.

        The folders are reached from ``base`` without following links (see :class:`LogFolder`), made
        0700 when missing, and get a ``.gitignore`` holding ``*``: the log folder always, each folder
        made here too. On failure nothing is left: no file, no folder or ``.gitignore`` this call made.

        Args:
            directory: the log folder.
            base: the folder the walk starts from, opened as it is (the project directory; ``None``: the
                nearest existing folder above ``directory``).

        Raises:
            UntrustedPathError: a folder on the way is a symbolic link or another user's.
            SpawnError: a file is in the way, or a folder cannot be made (reason ``"bad log folder"``).
            OSError: a file cannot be created.
        """
        folder = LogFolder.make(directory, base=base)
        made: list[tuple[str, tuple[int, int]]] = []
        try:
            with folder.opened() as fd:
                for stream in STREAMS:
                    made.append(_make_file(fd, stream))
        except BaseException:
            with contextlib.suppress(OSError), folder.opened() as fd:
                for name, _ in made:
                    os.unlink(name, dir_fd=fd)
            folder.unmake()
            raise
        files = {
            stream: LogFile(os.path.join(folder.path, name), folder=folder, identity=identity)
            for stream, (name, identity) in zip(STREAMS, made, strict=True)
        }
        return cls(directory=folder.path, files=files, folder=folder)

    def path(self, stream: Stream) -> str:
        """Where the ``stream`` file is now."""
        return self._files[stream].path

    @property
    def paths(self) -> tuple[str, str]:
        """``(stdout path, stderr path)``, where they are now."""
        return self._files["stdout"].path, self._files["stderr"].path

    @contextlib.contextmanager
    def open_for_child(self) -> Iterator[tuple[int, int]]:
        """``(stdout fd, stderr fd)`` for a child: the two files opened ``O_WRONLY | O_APPEND`` without
        following a link, closed when the block is left (the child keeps its copies).

        Raises:
            FileNotFoundError: a file is gone or is not the one made by :meth:`create`.
        """
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
        link is renamed as a link, never followed.

        Raises:
            OSError: a rename failed; each file is where its path says.
        """
        finals = [os.path.basename(p) for p in final_log_paths(self.directory, pid)]
        with self._folder.opened() as fd:
            if any(_exists(fd, name) for name in finals):
                generation = 1
                while any(
                    _exists(fd, os.path.basename(p)) for p in final_log_paths(self.directory, pid, generation)
                ):
                    generation += 1
                aside = final_log_paths(self.directory, pid, generation)
                owners = {log.path: log for pair in others for log in pair._files.values()}
                for old, new in zip(finals, aside, strict=True):
                    old_path = os.path.join(self.directory, old)
                    if _exists(fd, old):
                        os.rename(old, os.path.basename(new), src_dir_fd=fd, dst_dir_fd=fd)
                    if old_path in owners:
                        owners[old_path].path = new
            for stream, name in zip(STREAMS, finals, strict=True):
                log = self._files[stream]
                os.rename(os.path.basename(log.path), name, src_dir_fd=fd, dst_dir_fd=fd)
                log.path = os.path.join(self.directory, name)

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

    def modified_at(self) -> datetime | None:
        """The later modification time of the two files (aware UTC), or ``None`` when both are gone."""
        times = [info.st_mtime for info in (log.stat() for log in self._files.values()) if info is not None]
        return datetime.fromtimestamp(max(times), UTC) if times else None

    def delete(self) -> None:
        """Delete both files (missing is fine); the folder stays.

        Only the files the engine made are deleted, and a link, FIFO or socket a child put in their place
        (a directory entry of the engine's own folder; nothing it points to is touched). Another regular
        file at a log's path is left alone.
        """
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
