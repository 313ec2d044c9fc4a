"""The engine's group records as one append-only journal: a line per run started and per run ended.

In process-group containment every run's group is recorded in the state directory before ``spawn``
returns, so that the next engine's start-up sweep can end it if both the engine and its guardian die.
One file per run cost an inode allocation and a removal per spawn (0.02 ms on a quiet filesystem, 0.3 ms
in a crowded ``/tmp`` here); one ``O_APPEND`` write of a line costs a few microseconds. The journal
``groups/.journal-<token>`` holds the same lines the guardian's pipe does (``+ pgid sid start_time
marker``, ``- pgid start_time``); reading it back replays them. Each line is one ``write`` to a file
opened ``O_APPEND``, so a crash leaves whole lines (a line that is not whole is skipped). The file is
rewritten with only the live records (a new file renamed into place) once it holds many ended ones.

It is removed with the engine's token (``_sweep.remove_token``): at a graceful exit, by the guardian
once it has ended the runs, or by the sweep.

Standard library only: the guardian and the sweep read it without the engine's dependencies.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Final, final

if TYPE_CHECKING:
    from ._sweep import GroupRecord

__all__ = ["JOURNAL_PREFIX", "GroupJournal", "apply_group_line", "journal_path", "read_journal"]

#: Journal files in ``groups/``: ``.journal-<token>``.
JOURNAL_PREFIX: Final = ".journal-"
#: Rewrite the journal once it holds this many lines and four times as many as live records.
_COMPACT_LINES: Final = 4096
_FLAGS: Final = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW


def journal_path(records: Path, token: str) -> Path:
    """The journal of the engine with ``token`` in the folder ``records`` (``<state_dir>/groups``)."""
    return records / f"{JOURNAL_PREFIX}{token}"


def read_journal(path: Path) -> list[GroupRecord]:
    """The records a journal leaves live (started, not ended), in the order they started.

    Raises:
        OSError: the file cannot be read.
    """
    live: dict[tuple[int, int], GroupRecord] = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        kind, _, rest = line.partition(" ")
        with contextlib.suppress(ValueError):  # a line cut short by a crash, or not ours
            apply_group_line(live, kind, rest)
    return list(live.values())


def apply_group_line(live: dict[tuple[int, int], GroupRecord], kind: str, rest: str) -> bool:
    """Apply one journal or guardian line to ``live`` (keyed by pgid and start time): ``+ record`` (a
    group started) adds it, ``- pgid start_time`` (it ended) drops it. Whether the line was one of them.

    Raises:
        ValueError: a line of those kinds that does not parse.
    """
    from ._sweep import GroupRecord

    if kind == "+":
        record = GroupRecord.parse(rest)
        live[(record.pgid, record.start_time)] = record
        return True
    if kind == "-":
        pgid, start = rest.split()
        live.pop((int(pgid), int(start)), None)
        return True
    return False


@final
class GroupJournal:
    """The engine's end of the journal: :meth:`add` and :meth:`drop` append a line each."""

    __slots__ = ("_fd", "_lines", "_live", "_path")

    def __init__(self, records: Path, token: str) -> None:
        self._path = journal_path(records, token)
        self._fd = os.open(self._path, _FLAGS, 0o600)
        self._live: dict[tuple[int, int], GroupRecord] = {}
        self._lines = 0

    def __repr__(self) -> str:
        return f"<GroupJournal {self._path}: {len(self._live)} live>"

    def add(self, record: GroupRecord) -> None:
        """Record a group that started (before ``spawn`` returns).

        Raises:
            OSError: the line could not be written (a full disk): the caller kills the run.
        """
        self._append(f"+ {record.line()}\n")
        self._live[(record.pgid, record.start_time)] = record

    def drop(self, record: GroupRecord) -> None:
        """Record that a group ended; a failure to write is ignored (the sweep then finds it gone)."""
        self.drop_many([record])

    def drop_many(self, records: Iterable[GroupRecord]) -> None:
        """:meth:`drop` of each of ``records``, in one write (the lines stay whole: a crash in the middle
        leaves some of them, and a line cut short is skipped when the journal is read)."""
        lines = []
        for record in records:
            self._live.pop((record.pgid, record.start_time), None)
            lines.append(f"- {record.pgid} {record.start_time}\n")
        if not lines:
            return
        with contextlib.suppress(OSError):
            self._append("".join(lines), len(lines))
            if self._lines >= _COMPACT_LINES and self._lines >= 4 * len(self._live):
                self._compact(self._live.values())

    def _append(self, text: str, lines: int = 1) -> None:
        """Append ``text`` (``lines`` whole lines) in one ``write``."""
        if self._fd < 0:
            raise OSError(f"the group journal {self._path} is closed")
        data = text.encode()
        written = os.write(self._fd, data)
        while written < len(data):  # a regular file writes it whole but for a full disk (then OSError)
            written += os.write(self._fd, data[written:])
        self._lines += lines

    def _compact(self, live: Iterable[GroupRecord]) -> None:
        """Rewrite the journal with only the live records: a new file, renamed into place."""
        temp = self._path.with_name(self._path.name + ".tmp")
        fd = os.open(temp, _FLAGS | os.O_TRUNC, 0o600)
        try:
            lines = [f"+ {record.line()}\n" for record in live]
            os.write(fd, "".join(lines).encode())
            os.replace(temp, self._path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                temp.unlink()
            raise
        os.close(self._fd)
        self._fd, self._lines = fd, len(lines)

    def close(self) -> None:
        """Close the file (it stays; :func:`~engine._sweep.remove_token` removes it)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
