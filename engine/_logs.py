"""Subprocess log files: their names, paging reads for agents, and the per-stream size cap.

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
import ctypes.util
import errno
import os
import tempfile
from typing import IO, Literal

import attrs

__all__ = [
    "STREAMS",
    "LogFile",
    "LogSlice",
    "Stream",
    "check_stream",
    "create_temp_logs",
    "final_log_paths",
    "prepare_log_dir",
]

Stream = Literal["stdout", "stderr"]
STREAMS: tuple[Stream, Stream] = ("stdout", "stderr")

_CHUNK = 1 << 20
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_NO_PUNCH = {errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.ENOTSUP}


def _load_fallocate() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]  # ctypes' private base type
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        func = getattr(libc, "fallocate64", None) or libc.fallocate
    except (OSError, AttributeError):
        return None
    func.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    func.restype = ctypes.c_int
    return func


_fallocate = _load_fallocate()


def check_stream(stream: object) -> Stream:
    """Return ``stream`` when it names a log stream.

    Raises:
        ValueError: it is neither ``"stdout"`` nor ``"stderr"``.
    """
    if stream == "stdout" or stream == "stderr":
        return stream
    raise ValueError(f'stream must be "stdout" or "stderr", got {stream!r}')


def prepare_log_dir(path: str) -> list[str]:
    """Create the log folder (mode 0700) and its missing parents; return the folders it created.

    The caller removes the returned folders again (innermost first) when the spawn they were made for
    fails, so a rejected ``create`` leaves nothing behind.
    """
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


def create_temp_logs(directory: str) -> tuple[str, str]:
    """Create two empty files (mode 0600) under temporary names, for a child's stdout and stderr."""
    paths: list[str] = []
    try:
        for stream in STREAMS:
            fd, path = tempfile.mkstemp(prefix=".subproc-", suffix=f".{stream}.log.tmp", dir=directory)
            os.close(fd)
            paths.append(path)
    except BaseException:
        for path in paths:
            _unlink_quietly(path)
        raise
    return paths[0], paths[1]


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


def _complete_utf8_prefix(data: bytes) -> bytes:
    """``data`` without an incomplete UTF-8 sequence at its end (when a byte cap cut one)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # a lead byte (or ASCII)
            need = 1 if byte < 0x80 else 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4
            return data[:-back] if need > back and byte >= 0xC0 else data
    return data


def _skip_utf8_continuations(data: bytes) -> int:
    """How many continuation bytes open ``data`` (at most 3), when a cut landed inside a character."""
    n = 0
    while n < min(3, len(data)) and data[n] & 0xC0 == 0x80:
        n += 1
    return n


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
            if self.punch and _fallocate is not None:
                dropped = self._punch(fd, st, cap_bytes)
                if dropped >= 0:
                    return dropped
                self.punch = False
            return self._copy_tail(fd, cap_bytes)
        finally:
            os.close(fd)

    def _punch(self, fd: int, st: os.stat_result, cap_bytes: int) -> int:
        assert _fallocate is not None
        block = max(st.st_blksize, 512)
        start = self.dropped - self.base
        end = (st.st_size - cap_bytes) // block * block
        if end <= start:
            return 0
        if _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, start, end - start) != 0:
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
                chunk = os.pread(fd, min(_CHUNK, size - src), src)
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
        """Every byte still kept, decoded (invalid UTF-8 replaced).

        Raises:
            FileNotFoundError: the file is gone.
        """
        with open(self.path, "rb") as f:
            f.seek(self.dropped - self.base)
            return f.read().decode("utf-8", "replace")

    def read(self, *, offset: int | None, limit: int | None, tail: int | None, max_bytes: int) -> LogSlice:
        """Read a bounded slice: forward from ``offset`` (``limit`` lines at most) or the last ``tail`` lines.

        Without ``offset`` and ``tail`` it reads forward from the oldest kept byte. At most ``max_bytes``
        bytes are returned; a forward read cut by the cap ends on a whole UTF-8 character, a tail read
        keeps the newest bytes.

        Raises:
            FileNotFoundError: the file is gone.
        """
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            first = self.dropped - self.base  # physical position of the first kept byte
            if tail is not None:
                start, data = _read_tail(f, first, size, tail, max_bytes)
            else:
                want = first if offset is None else min(max(offset - self.base, first), size)
                start, data = want, _read_forward(f, want, size, limit, max_bytes)
            lines = _count_lines(f, first, size)
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


def _read_forward(f: IO[bytes], start: int, size: int, limit: int | None, max_bytes: int) -> bytes:
    f.seek(start)
    data = f.read(min(max_bytes, size - start))
    if limit is not None:
        cut = -1
        for _ in range(limit):
            cut = data.find(b"\n", cut + 1)
            if cut < 0:
                break
        if cut >= 0:
            return data[: cut + 1]
    if start + len(data) < size and len(data) == max_bytes:
        trimmed = _complete_utf8_prefix(data)
        if trimmed:
            return trimmed
    return data


def _read_tail(f: IO[bytes], first: int, size: int, tail: int, max_bytes: int) -> tuple[int, bytes]:
    """The last ``tail`` lines (a final line without ``\\n`` counts) within ``max_bytes``, read backwards."""
    floor = max(first, size - max_bytes)
    pos = size
    data = b""
    wanted = tail  # newlines to see: the one before each line shown...
    if size > first:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            wanted += 1  # ...plus the file's final one, which ends the last line
    seen = 0
    while pos > floor and seen < wanted:
        step = min(64 * 1024, pos - floor)
        pos -= step
        f.seek(pos)
        chunk = f.read(step)
        seen += chunk.count(b"\n")
        data = chunk + data
    stop = len(data) - 1 if data.endswith(b"\n") else len(data)
    cut = stop
    for _ in range(tail):
        cut = data.rfind(b"\n", 0, cut)
        if cut < 0:
            break
    if cut >= 0:
        return pos + cut + 1, data[cut + 1 :]
    if pos > first:  # the byte cap cut into a line: do not start inside a character
        skip = _skip_utf8_continuations(data)
        return pos + skip, data[skip:]
    return pos, data


def _count_lines(f: IO[bytes], first: int, size: int) -> int:
    if size <= first:
        return 0
    f.seek(first)
    count = 0
    last = b""
    remaining = size - first
    while remaining > 0:
        chunk = f.read(min(_CHUNK, remaining))
        if not chunk:
            break
        count += chunk.count(b"\n")
        remaining -= len(chunk)
        last = chunk[-1:]
    return count + (0 if last == b"\n" else 1)
