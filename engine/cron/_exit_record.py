"""The exit record a watched command's shim leaves in ``watch-logs/`` (:mod:`engine.cron._shim`), as the
engine reads it.

The record is a small JSON object (``{"pid", "exit_code" | "signal", "ended_at"}``) in a file the shim
renamed into place. The engine trusts nothing it finds there (``docs/security.md``): the file is opened
without following a link, its folder too, and without waiting on a FIFO
(:func:`~engine._trust.open_own_file`); a record that is not a regular file of the engine's user, or not
a JSON object, is no record, and the reason is kept for the message that says so.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Final

import attrs

from .._errors import UntrustedPathError
from .._trust import open_own_file

__all__ = ["ExitRecordRead", "read_exit_record", "remove_reserved", "remove_reserved_by_any"]

#: The most of a record file that is read, in bytes (the shim writes about 100, in 4096 reserved).
_MAX_RECORD_BYTES: Final = 65536


@attrs.frozen
class ExitRecordRead:
    """What reading an exit record gave.

    Attributes:
        record: the record, or ``None`` when there is none that can be used.
        problem: why a file that is there cannot be used ("is a FIFO, ...", "is not a JSON object"), or
            ``None`` (a record, or no file at all).
    """

    record: dict[str, object] | None
    problem: str | None = None


def read_exit_record(path: str) -> ExitRecordRead:
    """Read the record the shim wrote at ``path`` (blocking, bounded: run it in a worker thread).

    Never follows a link (at the file or at its folder), never waits on a FIFO, reads at most 64 KiB.
    A missing file, or a missing folder, is no record and no problem.
    """
    what = "the exit record"
    try:
        fd = open_own_file(path, os.O_RDONLY, what=what, folder_too=True)
    except FileNotFoundError:
        return ExitRecordRead(None)
    except UntrustedPathError as exc:
        return ExitRecordRead(None, str(exc))
    except OSError as exc:
        return ExitRecordRead(None, f"{what} {path} cannot be read: {exc.strerror or exc}")
    with os.fdopen(fd, "rb") as f:
        data = f.read(_MAX_RECORD_BYTES + 1)
    try:
        value = json.loads(data) if len(data) <= _MAX_RECORD_BYTES else None
    except ValueError:
        value = None
    if not isinstance(value, dict):
        return ExitRecordRead(None, f"{what} {path} is not a JSON object as the shim writes")
    return ExitRecordRead(value)


def remove_reserved(path: str, shim_pid: int) -> None:
    """Remove the temp file the shim ``shim_pid`` reserved for ``path``'s record and never renamed: what
    a shim killed with its command (SIGKILL, ``stop --end-watched`` of a command that ignores SIGINT)
    leaves behind. Missing is fine; call it once that shim has ended."""
    with contextlib.suppress(OSError):
        os.unlink(f"{path}.tmp.{shim_pid}")


def remove_reserved_by_any(path: str) -> list[int]:
    """Remove the temp files any shim reserved for ``path``'s record (``<path>.tmp.<pid>``), where the
    shim's pid is not known (its engine was killed before it stored the watch state); return the pids
    their names give (empty where there was none): each is a shim that started for that record, and
    the leader of the session its command ran in. Call it once no shim of that record runs."""
    folder, name = os.path.split(path)
    prefix = f"{name}.tmp."
    try:
        names = [n for n in os.listdir(folder or ".") if n.startswith(prefix) and n[len(prefix) :].isdigit()]
    except OSError:
        return []
    for found in names:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(folder, found))
    return sorted(int(n[len(prefix) :]) for n in names)
