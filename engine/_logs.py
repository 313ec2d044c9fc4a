"""Subprocess log files: one stream's file, its paging reads for agents and its size cap.

A child's two files are a :class:`~engine._logpair.LogPair` (creation, names, deletion); each file is a
:class:`LogFile`: capped while the child runs, read, and identified by the inode the engine made.

A child writes straight into its log files (the engine never sees its output), so the cap is enforced
from outside: every so often the engine looks at a file's size and drops its oldest part. Where the
filesystem can, it punches a hole (``fallocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE)``, as
``fallocate --punch-hole`` does): the blocks are freed, the file keeps its length, and every byte offset
stays valid while the child goes on appending. Where it cannot, the newest part is copied to the front
and the file truncated; the reader keeps counting in *logical* offsets (``base`` + physical position), so
offsets handed out earlier still mean the same bytes.

Reads never load more than the caller asked for: they seek and read bounded chunks, and start after the
dropped part (a punched region reads as zeros and is never returned).

Nothing is taken on trust (``docs/security.md``): the folder is reached without following links
(:class:`~engine._logdir.LogFolder`), each file is opened with ``O_NOFOLLOW | O_NONBLOCK`` from the folder's
descriptor, and the cap, the reads and the deletion act only on the inode the engine created (same device
and inode, a regular file): a link, a FIFO or another file put in its place is "gone", never followed,
read, punched or waited on. A file truncated from outside (``> log``) is noticed (it shrank): what it
holds now starts a new stretch of offsets after every offset handed out before, so readers see the new
lines and a follower's next offset still works.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import os
import stat
from collections.abc import Callable, Iterator
from typing import IO, TYPE_CHECKING, Literal, NamedTuple

import attrs

from . import _libc
from ._errors import InvalidArgumentError
from ._logdir import LogFolder, LogGoneError
from ._logread import LineIndex, read_forward, read_tail

if TYPE_CHECKING:
    from ctypes import _NamedFuncPointer

__all__ = [
    "STREAMS",
    "LogFile",
    "LogGoneError",
    "LogSlice",
    "RawPiece",
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
        InvalidArgumentError: it is neither ``"stdout"`` nor ``"stderr"`` (a ``ValueError``).
    """
    if stream == "stdout" or stream == "stderr":
        return stream
    raise InvalidArgumentError(f'stream must be "stdout" or "stderr", got {stream!r}')


def final_log_paths(directory: str, pid: int, generation: int | None = None) -> tuple[str, str]:
    """``subproc-<pid>.stdout.log`` / ``.stderr.log`` (or ``subproc-<pid>-<n>.*`` for an older record)."""
    stem = f"subproc-{pid}" if generation is None else f"subproc-{pid}-{generation}"
    return (os.path.join(directory, f"{stem}.stdout.log"), os.path.join(directory, f"{stem}.stderr.log"))


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
        skipped_bytes: for a ``new_only`` read, bytes written after the reader's last read that it can
            never see (the log cap dropped them, or the file was truncated from outside); the read
            restarted from the oldest kept byte. ``0`` otherwise.
    """

    text: str
    start_offset: int
    next_offset: int
    total_bytes: int
    total_lines: int
    dropped_bytes: int
    truncated: bool
    skipped_bytes: int = 0


class RawPiece(NamedTuple):
    """Undecoded bytes of a log read by :meth:`LogFile.read_raw`, in logical offsets."""

    start: int  #: offset of ``data[0]``
    data: bytes
    total: int  #: bytes written to the stream so far
    dropped: int  #: offset of the first byte still kept


@attrs.define(eq=False)
class LogFile:
    """One stream's log file and what the cap has dropped from it.

    Attributes:
        path: where the file is now (it moves when a reused pid sends an old record's files aside).
        base: logical offset of the file's physical byte 0 (grows in the copy fallback, and when the file
            was truncated from outside).
        dropped: logical offset of the first byte still kept; everything before it is gone.
        punch: whether hole punching is used (turned off for good on a filesystem that refuses it).
        folder: the folder the file is reached through (``None``: opened by ``path``, without following a
            link, for a file given by hand).
        identity: the file's ``(st_dev, st_ino)`` when the engine made it; another file at ``path`` is not
            this log (``None``: taken at the first open).
    """

    path: str
    base: int = 0
    dropped: int = 0
    punch: bool = True
    folder: LogFolder | None = attrs.field(default=None, kw_only=True)
    identity: tuple[int, int] | None = attrs.field(default=None, kw_only=True)
    _seen: int = attrs.field(init=False, default=0)  # the physical size last seen
    _warned: bool = attrs.field(init=False, default=False)
    _index: LineIndex | None = attrs.field(init=False, default=None)  # newlines counted so far

    # ---- opening the inode the engine made, and nothing else -----------------------------------------

    def _check(self, info: os.stat_result) -> None:
        if not stat.S_ISREG(info.st_mode):
            raise LogGoneError(errno.ENOENT, "not the log file the engine made (not a file)", self.path)
        if self.identity is None:
            self.identity = (info.st_dev, info.st_ino)
        elif (info.st_dev, info.st_ino) != self.identity:
            raise LogGoneError(errno.ENOENT, "not the log file the engine made (another file)", self.path)

    def _open(self, flags: int) -> int:
        """A descriptor of the log (``flags`` plus ``O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC``), checked to be
        the inode the engine made; anything else at its path raises :class:`LogGoneError`, never opened
        when ``lstat`` already tells (a FIFO is never waited on)."""
        flags |= os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            if self.folder is None:
                fd = os.open(self.path, flags)
            else:
                name = os.path.basename(self.path)
                with self.folder.opened() as folder:
                    self._check(os.stat(name, dir_fd=folder, follow_symlinks=False))
                    fd = os.open(name, flags, dir_fd=folder)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):  # a link, a FIFO, a folder
                raise LogGoneError(errno.ENOENT, "not the log file the engine made", self.path) from None
            raise
        try:
            self._check(os.fstat(fd))
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    @contextlib.contextmanager
    def opened(self, flags: int) -> Iterator[int]:
        """:meth:`_open` as a context manager that closes the descriptor.

        Raises:
            FileNotFoundError: the file is gone, or is not the one the engine made (:class:`LogGoneError`).
        """
        fd = self._open(flags)
        try:
            yield fd
        finally:
            os.close(fd)

    @property
    def seen_bytes(self) -> int:
        """The file's physical size at the last look (the cap's, a read's), in bytes; 0 before the first."""
        return self._seen

    def stat(self) -> os.stat_result | None:
        """``lstat`` of the file when it is still the one the engine made, else ``None``."""
        try:
            with self.opened(os.O_RDONLY) as fd:
                return os.fstat(fd)
        except OSError:
            return None

    def _observe(self, fd: int, size: int) -> None:
        """Notice a truncation from outside (the file shrank): what it holds now starts after every
        offset handed out so far, from its first byte of data (a punched hole that remains is skipped)."""
        first = self.dropped - self.base
        if size < self._seen or size < first:
            self.base += self._seen
            try:
                data = os.lseek(fd, 0, os.SEEK_DATA) if size else 0
            except OSError:  # ENXIO: only holes; EINVAL: no SEEK_DATA here
                data = size if self.punch else 0
            self.dropped = self.base + min(data, size)
            _log.warning("log %s was truncated from outside; reading on from what it holds now", self.path)
        self._seen = size

    # ---- the cap ---------------------------------------------------------------------------------

    def enforce_cap(self, cap_bytes: int, *, arm: Callable[[int], object] | None = None) -> int:
        """Drop the oldest bytes so that about ``cap_bytes`` stay on disk; return how many were dropped.

        With hole punching the kept part is at most ``cap_bytes`` plus one filesystem block (holes are
        block-aligned); the newest bytes are never touched. A missing file is left alone, and so is
        anything that is not the file the engine made (logged once).

        Args:
            cap_bytes: the size to keep.
            arm: called with the checked descriptor of the file before its size is read (the log cap
                arms its watch for the next write there, ``_logwatch``); not called when the file is gone.
        """
        try:
            fd = self._open(os.O_RDWR)
        except LogGoneError as gone:
            if not self._warned:
                self._warned = True
                _log.warning("log %s is not capped: %s", self.path, gone.strerror)
            return 0
        except FileNotFoundError:
            return 0
        try:
            if arm is not None:
                arm(fd)
            st = os.fstat(fd)
            self._observe(fd, st.st_size)
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
        index = self._index
        if index is not None:  # count what is dropped while it can still be read
            with os.fdopen(fd, "rb", closefd=False) as f:
                valid = index.base == self.base and index.first == start and index.move_first(f, end)
            if not valid:
                self._index = None
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
        self._seen = written
        self._index = None  # the kept bytes moved: counted afresh
        dropped = self.base + keep_from - self.dropped
        self.base += keep_from
        self.dropped = self.base
        return dropped

    # ---- reading ---------------------------------------------------------------------------------

    def _count_lines(self, f: IO[bytes], first: int, size: int) -> int:
        """The lines in ``[first, size)``, counting only what was appended since the last count."""
        index = self._index
        if index is None or index.base != self.base or index.first != first or size < index.end:
            index = self._index = LineIndex(base=self.base, origin=first)
        return index.lines(f, size)

    def read_all(self) -> str:
        """Every byte still kept, decoded (invalid UTF-8 replaced): :meth:`read` without bounds.

        Raises:
            FileNotFoundError: the file is gone, or is not the one the engine made.
        """
        return self.read(offset=None, limit=None, tail=None, max_bytes=None).text

    def read_raw(self, offset: int | None, max_bytes: int) -> RawPiece:
        """Up to ``max_bytes`` undecoded bytes forward from logical ``offset`` (``None``, or an offset in
        the dropped part: the first kept byte), for scans that decode and count by themselves (grep,
        readiness patterns); no line count, no UTF-8 trimming.

        Raises:
            FileNotFoundError: the file is gone, or is not the one the engine made (:class:`LogGoneError`).
        """
        with os.fdopen(self._open(os.O_RDONLY), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            self._observe(f.fileno(), size)
            first = self.dropped - self.base
            start = first if offset is None else min(max(offset - self.base, first), size)
            f.seek(start)
            data = f.read(min(max_bytes, size - start))
        return RawPiece(self.base + start, data, self.base + size, self.dropped)

    def read(
        self, *, offset: int | None, limit: int | None, tail: int | None, max_bytes: int | None
    ) -> LogSlice:
        """Read a slice: forward from ``offset`` (``limit`` lines at most) or the last ``tail`` lines.

        Without ``offset`` and ``tail`` it reads forward from the oldest kept byte. At most ``max_bytes``
        bytes are returned (``None``: every kept byte); a forward read cut by the cap ends on a whole
        UTF-8 character, a tail read keeps the newest bytes.

        Raises:
            FileNotFoundError: the file is gone, or is not the one the engine made (:class:`LogGoneError`).
        """
        with os.fdopen(self._open(os.O_RDONLY), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            self._observe(f.fileno(), size)
            first = self.dropped - self.base  # physical position of the first kept byte
            if tail is not None:
                start, data = read_tail(f, first, size, tail, max_bytes)
            else:
                want = first if offset is None else min(max(offset - self.base, first), size)
                start, data = want, read_forward(f, want, size, limit, max_bytes)
            lines = self._count_lines(f, first, size)
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
