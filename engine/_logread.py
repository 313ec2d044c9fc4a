"""Reading a log file in bounded pieces: forward by lines, the last lines, line counts, UTF-8 cuts.

These work on a file object and physical positions; :class:`~engine._logs.LogFile` turns them into
logical offsets and a :class:`~engine._logs.LogSlice`. A bound of ``None`` bytes means "every kept byte".

Line counts: a log only grows at its end, and the cap only drops a prefix, so a :class:`LineIndex` counts
each byte once: a call counts only what was appended since the last one (a 50 MiB log is counted once,
then every ``log`` call costs what the child wrote since), and a prefix dropped by the cap is subtracted
with at most one chunk read.
"""

from __future__ import annotations

from typing import IO

import attrs

__all__ = ["LineIndex", "count_lines", "read_forward", "read_tail"]

_CHUNK = 1 << 20


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


def read_forward(f: IO[bytes], start: int, size: int, limit: int | None, max_bytes: int | None) -> bytes:
    """The bytes from ``start`` up to ``size``: ``limit`` whole lines at most, ``max_bytes`` at most,
    and, when the byte bound cut the text, ending on a whole UTF-8 character."""
    f.seek(start)
    data = f.read(size - start if max_bytes is None else min(max_bytes, size - start))
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


def read_tail(f: IO[bytes], first: int, size: int, tail: int, max_bytes: int | None) -> tuple[int, bytes]:
    """The last ``tail`` lines (a final line without ``\\n`` counts) within ``max_bytes``, read backwards,
    and where they start; ``first`` is the first kept byte."""
    floor = first if max_bytes is None else max(first, size - max_bytes)
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


def count_lines(f: IO[bytes], first: int, size: int) -> int:
    """The lines between ``first`` and ``size`` (a last line without ``\\n`` counts)."""
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


@attrs.define(eq=False)
class LineIndex:
    """The newlines of one file counted so far, from physical position ``origin`` on.

    ``marks[k]`` is the count in ``[origin, origin + k * chunk)``, so the count up to any position
    already counted is one mark plus at most one chunk read. The index is only valid while the bytes
    from ``origin`` keep their physical positions (see :class:`~engine._logs.LogFile`, which drops it
    when they move).

    Attributes:
        base: the file's logical base when the index was made (a new base means the bytes moved).
        origin: physical position where counting started.
        first: the first kept physical position the count is for.
        before_first: newlines in ``[origin, first)``.
        end: physical position counted up to.
        count: newlines in ``[origin, end)``.
        marks: counts at each chunk boundary from ``origin``.
        chunk: the distance between marks, in bytes.
    """

    base: int
    origin: int
    first: int = attrs.field(default=attrs.Factory(lambda self: self.origin, takes_self=True))
    before_first: int = 0
    end: int = attrs.field(default=attrs.Factory(lambda self: self.origin, takes_self=True))
    count: int = 0
    marks: list[int] = attrs.field(factory=lambda: [0])
    chunk: int = attrs.field(factory=lambda: _CHUNK)

    def extend(self, f: IO[bytes], size: int) -> None:
        """Count the newlines of ``[end, size)`` (what was appended since the last call)."""
        while self.end < size:
            boundary = self.origin + len(self.marks) * self.chunk
            f.seek(self.end)
            data = f.read(min(boundary, size) - self.end)
            if not data:
                break
            self.count += data.count(b"\n")
            self.end += len(data)
            if self.end == boundary:
                self.marks.append(self.count)

    def upto(self, f: IO[bytes], pos: int) -> int:
        """The newlines in ``[origin, pos)``, for ``origin <= pos <= end`` (reads at most one chunk)."""
        k = (pos - self.origin) // self.chunk
        start = self.origin + k * self.chunk
        f.seek(start)
        return self.marks[k] + f.read(pos - start).count(b"\n")

    def move_first(self, f: IO[bytes], first: int) -> bool:
        """Account for a prefix dropped up to ``first``, while its bytes can still be read; ``False``
        (the index is useless then) when ``first`` lies beyond what was counted."""
        if not self.first <= first <= self.end:
            return False
        self.before_first = self.upto(f, first)
        self.first = first
        return True

    def lines(self, f: IO[bytes], size: int) -> int:
        """The lines in ``[first, size)`` (a last line without ``\\n`` counts), counting what is new."""
        self.extend(f, size)
        if size <= self.first:
            return 0
        f.seek(size - 1)
        return self.count - self.before_first + (0 if f.read(1) == b"\n" else 1)
