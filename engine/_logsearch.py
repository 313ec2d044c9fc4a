"""``grep`` over a subprocess log: the matching lines with their numbers, within a byte budget and a time
bound.

The log is read in pieces of :data:`CHUNK_BYTES` under the service's log lock (each piece a short read),
and the pattern runs on each piece in a worker thread without the lock (:mod:`engine._patterns`), so a
slow pattern never holds up the log cap, other reads or the engine's shutdown, and another project's reads
go on. The whole call answers within :data:`~engine._patterns.ANSWER_SECONDS`: a pattern that runs out of
time is a :class:`~engine._patterns.PatternTimeoutError`.

Lines are numbered from the first byte the log still keeps (line 1), as ``grep -n`` numbers a file; once
the log cap has dropped the oldest output, the numbers start again from what is kept. Each matching line
is shown once as ``<number>: <line>``, cut at :data:`LINE_CHARS` characters with the count of the
characters left out.

A line longer than a piece is read on piece by piece (:class:`_LongLine`): the pattern runs on each piece
until one matches, and only the line's first :data:`LINE_CHARS` characters and its length are kept, so a
line of gigabytes is never held at once. Its pieces are searched one by one: a match across a boundary
between two of them is not found, and ``^`` and ``$`` also match at those boundaries.
"""

from __future__ import annotations

import codecs
import collections
import functools
import time
from collections.abc import Callable
from typing import Final, TypeVar

import attrs
import trio

from ._logpair import LogPair
from ._logs import LogSlice, RawPiece, Stream
from ._patterns import ANSWER_SECONDS, REGEX_SECONDS, Pattern, search_lines, timed_out

__all__ = ["CHUNK_BYTES", "LINE_CHARS", "grep_log"]

#: How much of the file one locked read takes, in bytes.
CHUNK_BYTES: Final = 1 << 20
#: The longest part of one matching line shown, in characters.
LINE_CHARS: Final = 2000


_T = TypeVar("_T")


@attrs.frozen
class _Hit:
    number: int  # the line number
    offset: int  # the logical offset of the line's first byte
    head: str  # the line's first LINE_CHARS characters
    chars: int  # the whole line's length in characters (without its newline)


def _shown(hit: _Hit) -> str:
    line = hit.head
    if hit.chars > len(hit.head):
        line = f"{hit.head}... [line cut: {hit.chars - len(hit.head)} more characters]"
    return f"{hit.number}: {line}\n"


def _hits(pattern: Pattern, raw: bytes, start: int, number: int, deadline: float) -> list[_Hit]:
    """The matching lines of ``raw`` (whole lines from logical offset ``start``, the first numbered
    ``number``). Runs in a worker thread.

    Raises:
        TimeoutError: the pattern ran past ``deadline`` (``time.monotonic()``).
    """
    text = raw.decode("utf-8", "replace")  # newlines stay where they were: offsets follow them
    hits: list[_Hit] = []
    line_at = 0  # character position of the line being counted from
    byte_at = 0  # its byte position in raw
    for begin, end in search_lines(pattern, text, deadline):
        skipped = text.count("\n", line_at, begin)
        for _ in range(skipped):
            byte_at = raw.index(b"\n", byte_at) + 1
        number += skipped
        line_at = begin
        head = text[begin : min(end, begin + LINE_CHARS)]
        hits.append(_Hit(number=number, offset=start + byte_at, head=head, chars=end - begin))
    return hits


def _utf8_decoder() -> codecs.IncrementalDecoder:
    return codecs.getincrementaldecoder("utf-8")("replace")


@attrs.define(eq=False)
class _LongLine:
    """A line longer than a piece, read on piece by piece: its first :data:`LINE_CHARS` characters, its
    length so far, and whether the pattern matched one of its pieces (then the rest is only counted)."""

    number: int  # the line number
    offset: int  # the logical offset of the line's first byte
    head: str = ""
    chars: int = 0
    matched: bool = False
    _decoder: codecs.IncrementalDecoder = attrs.field(factory=_utf8_decoder, init=False)

    def take(self, pattern: Pattern, part: bytes, deadline: float, *, final: bool) -> None:
        """Add the next ``part`` of the line (without a newline; ``final``: the last). Runs in a worker
        thread.

        Raises:
            TimeoutError: the pattern ran past ``deadline`` (``time.monotonic()``).
        """
        text = self._decoder.decode(part, final)  # a character cut between two parts is counted once
        if not self.matched:
            self.matched = next(search_lines(pattern, text, deadline), None) is not None
        self.head += text[: LINE_CHARS - len(self.head)]
        self.chars += len(text)

    def hit(self) -> _Hit:
        return _Hit(number=self.number, offset=self.offset, head=self.head, chars=self.chars)


async def _in_thread(work: Callable[[], _T]) -> _T:
    """``work()`` in a worker thread (abandoned when cancelled).

    Raises:
        PatternTimeoutError: the pattern ran out of time (:data:`~engine._patterns.REGEX_SECONDS`).
    """
    try:
        return await trio.to_thread.run_sync(work, abandon_on_cancel=True)
    except TimeoutError:
        raise timed_out("grep", REGEX_SECONDS) from None


@attrs.define(eq=False)
class _Reader:
    """Bounded reads of one stream under the service's log lock."""

    logs: LogPair
    stream: Stream
    lock: trio.Lock

    async def read(self, offset: int | None, max_bytes: int = CHUNK_BYTES) -> RawPiece:
        async with self.lock:
            return await trio.to_thread.run_sync(self.logs.read_raw, self.stream, offset, max_bytes)

    async def count_lines(self, start: int, stop: int) -> int:
        """The newlines between logical offsets ``start`` and ``stop``."""
        count = 0
        while start < stop:
            piece = await self.read(start, min(CHUNK_BYTES, stop - start))
            if not piece.data:
                break
            count += piece.data.count(b"\n")
            start = piece.start + len(piece.data)
        return count


async def grep_log(
    logs: LogPair,
    stream: Stream,
    pattern: Pattern,
    lock: trio.Lock,
    *,
    offset: int | None,
    limit: int | None,
    tail: int | None,
    max_bytes: int,
) -> LogSlice:
    """The lines of one log that ``pattern`` matches, numbered, within ``max_bytes`` of text.

    Forward (the default): from ``offset`` (``None``: the first kept byte), at most ``limit`` lines; when
    the budget or ``limit`` stops it, ``next_offset`` is where the first line not shown starts (pass it
    as ``offset`` to go on) and ``truncated`` is set. With ``tail``: the last ``tail`` matching lines of
    the whole log (``truncated``: earlier matches left out).

    Cancellation: safe; nothing changes.

    Raises:
        PatternTimeoutError: the pattern ran out of time (:data:`~engine._patterns.ANSWER_SECONDS`).
        FileNotFoundError: the log is gone.
    """
    reader = _Reader(logs, stream, lock)
    with trio.move_on_after(ANSWER_SECONDS):
        return await _grep(reader, pattern, offset=offset, limit=limit, tail=tail, max_bytes=max_bytes)
    raise timed_out("grep", ANSWER_SECONDS)


async def _grep(
    reader: _Reader,
    pattern: Pattern,
    *,
    offset: int | None,
    limit: int | None,
    tail: int | None,
    max_bytes: int,
) -> LogSlice:
    head = await reader.read(None, 0)
    start = head.dropped if offset is None else min(max(offset, head.dropped), head.total)
    newlines = await reader.count_lines(head.dropped, start)
    deadline = time.monotonic() + REGEX_SECONDS
    kept: collections.deque[_Hit] = collections.deque(maxlen=tail)
    matched = 0
    forward: list[_Hit] = []
    used = 0
    stopped_at: int | None = None  # forward: where the first line not shown starts
    pos, carry, last = start, b"", b""
    total = head.total
    long: _LongLine | None = None  # a line longer than a piece, under way
    while True:
        piece = await reader.read(pos)
        total = piece.total
        pos = piece.start + len(piece.data)
        at_end = len(piece.data) < CHUNK_BYTES
        data, carry = carry + piece.data, b""
        at = pos - len(data)  # the logical offset of data[0]
        hits: list[_Hit] = []
        if long is None and not at_end and b"\n" not in data:  # a line longer than a piece begins
            long = _LongLine(number=newlines + 1, offset=at)
        if long is not None:
            newline = data.find(b"\n")
            part = data if newline < 0 else data[:newline]
            final = newline >= 0 or at_end
            await _in_thread(functools.partial(long.take, pattern, part, deadline, final=final))
            last = part[-1:] or last
            if not final:
                continue
            if long.matched:
                hits.append(long.hit())
            long = None
            if newline >= 0:
                newlines += 1
                last = b"\n"
                data, at = data[newline + 1 :], at + newline + 1
            else:
                data = b""
        cut = len(data) if at_end else data.rfind(b"\n") + 1
        block, carry = data[:cut], data[cut:]
        if block:
            hits += await _in_thread(functools.partial(_hits, pattern, block, at, newlines + 1, deadline))
        newlines += block.count(b"\n")
        last = block[-1:] or last
        matched += len(hits)
        if tail is not None:
            kept.extend(hits)
        else:
            for hit in hits:
                size = len(_shown(hit).encode())
                if (limit is not None and len(forward) >= limit) or (forward and used + size > max_bytes):
                    stopped_at = hit.offset
                    break
                forward.append(hit)
                used += size
        if at_end or stopped_at is not None:
            break
    if stopped_at is not None:  # count the lines of the rest, for total_lines
        newlines += await reader.count_lines(pos, total)
        rest = await reader.read(total - 1, 1) if total > head.dropped else None
        last = rest.data if rest is not None and rest.data else last
    lines = newlines + (1 if last and last != b"\n" else 0)
    if tail is not None:
        shown: list[str] = []
        first = pos
        for hit in reversed(kept):
            text = _shown(hit)
            if shown and used + len(text.encode()) > max_bytes:
                break
            shown.append(text)
            used += len(text.encode())
            first = hit.offset
        return LogSlice(
            text="".join(reversed(shown)),
            start_offset=first,
            next_offset=pos,
            total_bytes=total,
            total_lines=lines,
            dropped_bytes=head.dropped,
            truncated=len(shown) < matched,
        )
    return LogSlice(
        text="".join(_shown(hit) for hit in forward),
        start_offset=start,
        next_offset=pos if stopped_at is None else stopped_at,
        total_bytes=total,
        total_lines=lines,
        dropped_bytes=head.dropped,
        truncated=stopped_at is not None,
    )
