"""Subprocess log files: a child's pair of files from creation to deletion, paging reads for agents,
and the per-stream size cap.

A :class:`LogPair` is the two files of one child: created under temporary names before the spawn, given
their final names (``subproc-<pid>.stdout.log`` / ``.stderr.log``) once the pid is known, capped while
the child runs, read, and deleted by ``kill``. Each file is a :class:`LogFile`.

A child writes straight into its log files (the engine never sees its output), so the cap is enforced
from outside: every so often the engine looks at a file's size and drops its oldest part. Where the
filesystem can, it punches a hole (``fallocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE)``, as
``fallocate --punch-hole`` does): the blocks are freed, the file keeps its length, and every byte offset
stays valid while the child goes on appending. Where it cannot, the newest part is copied to the front
and the file truncated; the reader keeps counting in *logical* offsets (``base`` + physical position), so
offsets handed out earlier still mean the same bytes.

Reads never load more than the caller asked for: they seek and read bounded chunks, and start after the
dropped part (a punched region reads as zeros and is never returned).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import tempfile
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Literal, final

import attrs

from . import _libc
from ._logread import count_lines, read_forward, read_tail

if TYPE_CHECKING:
    from ctypes import _NamedFuncPointer

__all__ = [
    "STREAMS",
    "LogFile",
    "LogPair",
    "LogSlice",
    "Stream",
    "check_stream",
    "final_log_paths",
]

_log = logging.getLogger("engine.subprocesses")

Stream = Literal["stdout", "stderr"]
STREAMS: tuple[Stream, Stream] = ("stdout", "stderr")

_COPY_CHUNK = 1 << 20
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_NO_PUNCH = {errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.ENOTSUP}


@functools.cache
def _fallocate() -> _NamedFuncPointer | None:
    func = _libc.function("fallocate64") or _libc.function("fallocate")
    if func is not None:
        func.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        func.restype = ctypes.c_int
    return func


def check_stream(stream: object) -> Stream:
    """Return ``stream`` when it names a log stream.

    Raises:
        ValueError: it is neither ``"stdout"`` nor ``"stderr"``.
    """
    if stream == "stdout" or stream == "stderr":
        return stream
    raise ValueError(f'stream must be "stdout" or "stderr", got {stream!r}')


def final_log_paths(directory: str, pid: int, generation: int | None = None) -> tuple[str, str]:
    """``subproc-<pid>.stdout.log`` / ``.stderr.log`` (or ``subproc-<pid>-<n>.*`` for an older record)."""
    stem = f"subproc-{pid}" if generation is None else f"subproc-{pid}-{generation}"
    return (os.path.join(directory, f"{stem}.stdout.log"), os.path.join(directory, f"{stem}.stderr.log"))


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@attrs.frozen
class LogSlice:
    """A bounded piece of one log, with the facts needed to ask for more.

    Offsets are logical byte offsets: byte ``n`` is the ``n``-th byte the child ever wrote to the stream,
    whatever the cap dropped since.

    Attributes:
        text: the bytes read, decoded as UTF-8 (invalid sequences replaced with U+FFFD).
        start_offset: offset of the first byte of ``text``.
        next_offset: offset just after the last byte of ``text`` (pass it as ``offset`` to read on).
        total_bytes: bytes written to the stream so far (dropped ones included).
        total_lines: lines still on disk (a last line without ``\\n`` counts).
        dropped_bytes: bytes removed from the front by the log cap; offsets below it return nothing.
        truncated: whether retained bytes exist before ``start_offset`` or after ``next_offset``.
    """

    text: str
    start_offset: int
    next_offset: int
    total_bytes: int
    total_lines: int
    dropped_bytes: int
    truncated: bool


@attrs.define(eq=False)
class LogFile:
    """One stream's log file and what the cap has dropped from it.

    Attributes:
        path: where the file is now (it moves when a reused pid sends an old record's files aside).
        base: logical offset of the file's physical byte 0 (grows only in the copy fallback).
        dropped: logical offset of the first byte still kept; everything before it is gone.
        punch: whether hole punching is used (turned off for good on a filesystem that refuses it).
    """

    path: str
    base: int = 0
    dropped: int = 0
    punch: bool = True

    # ---- the cap ---------------------------------------------------------------------------------

    def enforce_cap(self, cap_bytes: int) -> int:
        """Drop the oldest bytes so that about ``cap_bytes`` stay on disk; return how many were dropped.

        With hole punching the kept part is at most ``cap_bytes`` plus one filesystem block (holes are
        block-aligned); the newest bytes are never touched. A missing file is left alone.
        """
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return 0
        try:
            st = os.fstat(fd)
            if self.base + st.st_size - self.dropped <= cap_bytes:
                return 0
            if self.punch and _fallocate() is not None:
                dropped = self._punch(fd, st, cap_bytes)
                if dropped >= 0:
                    return dropped
                self.punch = False
            return self._copy_tail(fd, cap_bytes)
        finally:
            os.close(fd)

    def _punch(self, fd: int, st: os.stat_result, cap_bytes: int) -> int:
        fallocate = _fallocate()
        assert fallocate is not None
        block = max(st.st_blksize, 512)
        start = self.dropped - self.base
        end = (st.st_size - cap_bytes) // block * block
        if end <= start:
            return 0
        if fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, start, end - start) != 0:
            err = ctypes.get_errno()
            if err in _NO_PUNCH:
                return -1
            raise OSError(err, f"cannot punch a hole in {self.path}: {os.strerror(err)}")
        self.dropped = self.base + end
        return end - start

    def _copy_tail(self, fd: int, cap_bytes: int) -> int:
        """Fallback: move the newest ``cap_bytes`` to the front and truncate.

        The child appends (``O_APPEND``) while this runs; bytes that arrive during the copy are copied
        too, but a write landing between the last size check and the truncate (microseconds) is lost.
        Hole punching has no such window, which is why it is preferred.
        """
        size = os.fstat(fd).st_size
        keep_from = size - cap_bytes
        written = 0
        src = keep_from
        for _ in range(4):
            while src < size:
                chunk = os.pread(fd, min(_COPY_CHUNK, size - src), src)
                if not chunk:
                    break
                os.pwrite(fd, chunk, written)
                written += len(chunk)
                src += len(chunk)
            newer = os.fstat(fd).st_size
            if newer <= size:
                break
            size = newer
        os.ftruncate(fd, written)
        dropped = self.base + keep_from - self.dropped
        self.base += keep_from
        self.dropped = self.base
        return dropped

    # ---- reading ---------------------------------------------------------------------------------

    def read_all(self) -> str:
        """Every byte still kept, decoded (invalid UTF-8 replaced): :meth:`read` without bounds.

        Raises:
            FileNotFoundError: the file is gone.
        """
        return self.read(offset=None, limit=None, tail=None, max_bytes=None).text

    def read(
        self, *, offset: int | None, limit: int | None, tail: int | None, max_bytes: int | None
    ) -> LogSlice:
        """Read a slice: forward from ``offset`` (``limit`` lines at most) or the last ``tail`` lines.

        Without ``offset`` and ``tail`` it reads forward from the oldest kept byte. At most ``max_bytes``
        bytes are returned (``None``: every kept byte); a forward read cut by the cap ends on a whole
        UTF-8 character, a tail read keeps the newest bytes.

        Raises:
            FileNotFoundError: the file is gone.
        """
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            first = self.dropped - self.base  # physical position of the first kept byte
            if tail is not None:
                start, data = read_tail(f, first, size, tail, max_bytes)
            else:
                want = first if offset is None else min(max(offset - self.base, first), size)
                start, data = want, read_forward(f, want, size, limit, max_bytes)
            lines = count_lines(f, first, size)
        end = start + len(data)
        return LogSlice(
            text=data.decode("utf-8", "replace"),
            start_offset=self.base + start,
            next_offset=self.base + end,
            total_bytes=self.base + size,
            total_lines=lines,
            dropped_bytes=self.dropped,
            truncated=start > first or end < size,
        )


def _make_log_dir(path: str) -> list[str]:
    """Create the log folder (mode 0700) and its missing parents; return the folders made, innermost
    first."""
    missing: list[str] = []
    probe = path
    while not os.path.isdir(probe):
        missing.append(probe)
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return missing


def _remove_empty_dirs(folders: Iterable[str]) -> None:
    for folder in folders:  # innermost first; stop at the first that is not empty
        try:
            os.rmdir(folder)
        except OSError:
            break


@final
@attrs.define(eq=False)
class LogPair:
    """The two log files of one child, from creation (before the spawn) to deletion.

    Made by :meth:`create`. The files are created empty (mode 0600, in a folder of mode 0700) under
    temporary names, given to the child as its stdout and stderr, and renamed to their final names by
    :meth:`rename` once the pid is known; the child's descriptors follow a rename.

    Attributes:
        directory: the folder holding both files.
    """

    directory: str
    _files: dict[Stream, LogFile] = attrs.field(alias="files")
    _made: tuple[str, ...] = attrs.field(alias="made", default=())

    @classmethod
    def create(cls, directory: str) -> LogPair:
        """Create the folder (and its missing parents) and two empty files under temporary names.

        On failure nothing is left: no file, no folder this call made.

        Raises:
            OSError: a folder or a file cannot be created.
        """
        made = _make_log_dir(directory)
        paths: list[str] = []
        try:
            for stream in STREAMS:
                fd, path = tempfile.mkstemp(prefix=".subproc-", suffix=f".{stream}.log.tmp", dir=directory)
                os.close(fd)
                paths.append(path)
        except BaseException:
            for path in paths:
                _unlink_quietly(path)
            _remove_empty_dirs(made)
            raise
        files = {stream: LogFile(path) for stream, path in zip(STREAMS, paths, strict=True)}
        return cls(directory=directory, files=files, made=tuple(made))

    def path(self, stream: Stream) -> str:
        """Where the ``stream`` file is now."""
        return self._files[stream].path

    @property
    def paths(self) -> tuple[str, str]:
        """``(stdout path, stderr path)``, where they are now."""
        return self._files["stdout"].path, self._files["stderr"].path

    def rename(self, pid: int, others: Iterable[LogPair] = ()) -> None:
        """Give both files their final names, ``subproc-<pid>.stdout.log`` / ``.stderr.log``.

        Files already holding those names (a kept record of an earlier child that had the same pid)
        move aside first, to ``subproc-<pid>-<n>.*`` with the first free ``n``; the pair among
        ``others`` that owns them follows them.

        Raises:
            OSError: a rename failed; each file is where its path says.
        """
        finals = final_log_paths(self.directory, pid)
        if any(os.path.lexists(p) for p in finals):
            generation = 1
            while any(os.path.lexists(p) for p in final_log_paths(self.directory, pid, generation)):
                generation += 1
            aside = final_log_paths(self.directory, pid, generation)
            owners = {log.path: log for pair in others for log in pair._files.values()}
            for old, new in zip(finals, aside, strict=True):
                if os.path.lexists(old):
                    os.rename(old, new)
                if old in owners:
                    owners[old].path = new
        for stream, path in zip(STREAMS, finals, strict=True):
            log = self._files[stream]
            os.rename(log.path, path)
            log.path = path

    def enforce_cap(self, cap_bytes: int) -> int:
        """Keep each file within about ``cap_bytes`` (see :meth:`LogFile.enforce_cap`); a file that
        fails is logged and left as it is. Returns the bytes dropped."""
        dropped = 0
        for log in self._files.values():
            try:
                dropped += log.enforce_cap(cap_bytes)
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
            FileNotFoundError: the file is gone.
        """
        return self._files[stream].read(offset=offset, limit=limit, tail=tail, max_bytes=max_bytes)

    def modified_at(self) -> datetime | None:
        """The later modification time of the two files (aware UTC), or ``None`` when both are gone."""
        times = []
        for log in self._files.values():
            try:
                times.append(os.stat(log.path).st_mtime)
            except OSError:
                continue
        return datetime.fromtimestamp(max(times), UTC) if times else None

    def delete(self) -> None:
        """Delete both files (missing is fine); the folder stays."""
        for log in self._files.values():
            _unlink_quietly(log.path)

    def discard(self) -> None:
        """Undo :meth:`create`: delete both files and the folders it made, when they are empty."""
        self.delete()
        _remove_empty_dirs(self._made)
