"""A child's standard input as a pipe the engine keeps: written on request, closed at end of input or exit.

``create(..., stdin=True)`` gives the child the read end of a pipe (``pipe2(O_CLOEXEC)``; the spawn makes
a copy of it the child's fd 0, and the engine closes its own copy right after) and keeps the write end.
:meth:`StdinPipe.write` sends text or bytes to it, one writer at a time, and may close it (``eof``) so the
child reads end of input. The engine closes it when the child exits, and when the record is killed. No
pseudo-terminal: a program that asks ``isatty(0)`` gets "no", as under any pipe (Codex's unified exec and
``expect`` give a pty; this is the plain case).

A child that does not read blocks a write once the pipe's buffer (64 KiB on Linux) is full; callers bound
their writes (the tool waits :data:`~engine._tool.INPUT_WRITE_SECONDS`).
"""

from __future__ import annotations

import contextlib
import errno
import os
from typing import final

import attrs
import trio

from ._errors import EngineError

__all__ = ["StdinClosedError", "StdinPipe"]


class StdinClosedError(EngineError, ValueError):
    """Raised by ``SubProcessService.write_stdin`` when the process has no stdin pipe, its input was
    ended (``eof``), it exited, or it closed its end of the pipe."""


@final
@attrs.define(eq=False)
class StdinPipe:
    """The engine's end of one child's stdin pipe. Made by :meth:`open`.

    Attributes:
        pid: the child it feeds (for messages; ``0`` until the spawn).
        written_bytes: how many bytes were written so far.
    """

    _stream: trio.lowlevel.FdStream | None = attrs.field(alias="stream")
    pid: int = 0
    written_bytes: int = 0
    _lock: trio.Lock = attrs.field(init=False, factory=trio.Lock)
    _why_closed: str | None = attrs.field(init=False, default=None)

    @classmethod
    def open(cls) -> tuple[StdinPipe, int]:
        """A new pipe: the kept write end, and the read end for the child (the caller closes it once the
        child is spawned). Both are close-on-exec; the spawn's ``dup2`` gives the child its own fd 0.

        Raises:
            OSError: no pipe could be made (too many open files).
        """
        read_end, write_end = os.pipe2(os.O_CLOEXEC)
        try:
            stream = trio.lowlevel.FdStream(write_end)
        except BaseException:
            os.close(read_end)
            os.close(write_end)
            raise
        return cls(stream=stream), read_end

    @property
    def open_for_writing(self) -> bool:
        """Whether :meth:`write` can still send (not ended, child not gone)."""
        return self._why_closed is None

    def __repr__(self) -> str:
        state = "open" if self._why_closed is None else f"closed ({self._why_closed})"
        return f"<StdinPipe of {self.pid}: {state}, {self.written_bytes} bytes written>"

    async def write(self, data: bytes, *, eof: bool = False) -> int:
        """Send ``data`` to the child, then (``eof``) close the pipe so it reads end of input.

        Writers take turns: one call's bytes are never interleaved with another's.

        Cancellation: what was sent before the cancellation stays sent (a partial write is possible when
        the child was not reading); the pipe stays open.

        Returns:
            the bytes written (``len(data)``).

        Raises:
            StdinClosedError: the input was ended or the child exited (or closed its stdin); nothing sent.
        """
        async with self._lock:
            stream = self._stream
            if stream is None or self._why_closed is not None:
                raise self._closed_error()
            try:
                if data:
                    await stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.close("the process closed its stdin" if self._why_closed is None else self._why_closed)
                raise self._closed_error() from None
            except OSError as exc:  # pragma: no cover - EPIPE surfaces as BrokenResourceError in trio
                if exc.errno != errno.EPIPE:
                    raise
                self.close("the process closed its stdin")
                raise self._closed_error() from None
            self.written_bytes += len(data)
            if eof:
                self.close("the input was ended (eof)")
            return len(data)

    def close(self, why: str) -> None:
        """Close the write end (idempotent); a write waiting on a full pipe fails at once.

        Args:
            why: what a later :meth:`write` is told (``"the process exited"``).
        """
        if self._why_closed is None:
            self._why_closed = why
        stream, self._stream = self._stream, None
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()

    def _closed_error(self) -> StdinClosedError:
        return StdinClosedError(
            f"cannot write to the stdin of pid {self.pid}: {self._why_closed or 'it is closed'}; "
            "nothing was written"
        )
