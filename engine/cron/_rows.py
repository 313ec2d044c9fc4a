"""Reading the job store's rows into records, whatever the file holds.

A row is JSON (a job, its pending fire, its watch state) or columns (an event). The store reads every
row through here, in one of two ways:

- **strictly** (:func:`job_of`, :func:`event_of`, :func:`pending_of`, :func:`watch_state_of`): a row that
  is not a valid record raises ``ValueError``. The store's open check uses these: a row that cannot be
  read makes the store *damaged* (a clear start-up error, ``--repair`` to keep the rest).
- **leniently** (the ``*_or_none`` readers): the error is logged and the row skipped, so a row damaged
  while the engine runs never hides the others.

Text the engine never lets in (a lone surrogate, NUL: ``engine._input``) may still sit in a row written
by an older engine or planted in the file. It is shown escaped (``\\udcff``, ``\\x00``), never refused:
such a record cannot stop ``list``, ``cron list`` or a start-up, and nothing holding it reaches the
wire. Bytes that are not UTF-8 in a text column are read the same way (:func:`text_factory`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from .._input import escape_text
from ._events import PENDING_FIRE_FIELDS, FiredEvent, PendingFire
from ._job import CronJob
from ._watch_state import StoredWatch, stored_watch_from_dict

__all__ = [
    "EVENT_COLUMNS",
    "escape_strings",
    "event_of",
    "event_or_none",
    "job_of",
    "job_or_none",
    "pending_of",
    "pending_or_none",
    "text_factory",
    "watch_state_of",
    "watch_state_or_none",
]

logger = logging.getLogger("engine.cron")

_R = TypeVar("_R")

#: The columns of an event as :func:`event_of` reads them.
EVENT_COLUMNS = "cursor, job_id, project, " + ", ".join(PENDING_FIRE_FIELDS)


def text_factory(data: bytes) -> str:
    """SQLite text as ``str``; bytes that are not UTF-8 become lone surrogates (escaped later)."""
    return data.decode("utf-8", "surrogateescape")


def escape_strings(value: Any) -> Any:
    """``value`` (JSON-ish) with every string, keys included, passed through :func:`escape_text`."""
    if isinstance(value, str):
        return escape_text(value)
    if isinstance(value, dict):
        return {escape_text(k) if isinstance(k, str) else k: escape_strings(v) for k, v in value.items()}
    if isinstance(value, list):
        return [escape_strings(v) for v in value]
    return value


def _object(text: object, what: str) -> dict[str, Any]:
    if not isinstance(text, str):
        raise ValueError(f"the {what} is not text")
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        raise ValueError(f"the {what} is not JSON") from None
    if not isinstance(value, dict):
        raise ValueError(f"the {what} is not a JSON object")
    escaped: dict[str, Any] = escape_strings(value)
    return escaped


def _record(text: object, what: str, parse: Callable[[Mapping[str, Any]], _R]) -> _R:
    data = _object(text, what)
    try:
        return parse(data)
    except (ValueError, TypeError) as exc:  # InvalidArgumentError and InvalidScheduleError included
        raise ValueError(f"the {what} is not valid: {exc}") from None


def job_of(job_id: object, data: object) -> CronJob:
    """The job in row ``(id, data)``.

    Raises:
        ValueError: the row is not a valid job record (or holds another id).
    """
    job = _record(data, "record", CronJob.from_dict)
    if not isinstance(job_id, str) or job.id != escape_text(job_id):
        raise ValueError(f"the record holds id {job.id!r}")
    return job


def pending_of(text: object) -> PendingFire | None:
    """The pending fire in a ``pending_fire`` column (``None``: none).

    Raises:
        ValueError: the column holds something that is not a fire.
    """
    return None if text is None else _record(text, "pending fire", PendingFire.from_dict)


def watch_state_of(text: object) -> StoredWatch | None:
    """The watch state (or the arm before its spawn) in a ``watch_state`` column (``None``: none).

    Raises:
        ValueError: the column holds something that is neither.
    """
    return None if text is None else _record(text, "watch state", stored_watch_from_dict)


def event_of(row: tuple[Any, ...]) -> FiredEvent:
    """The event in a row of :data:`EVENT_COLUMNS`.

    Raises:
        ValueError: the row is not a valid event.
    """
    cursor, job_id, project, *rest = row
    fields = escape_strings(dict(zip(PENDING_FIRE_FIELDS, rest, strict=True)))
    fields["truncated"] = bool(fields["truncated"])
    try:
        fire = PendingFire.from_dict(fields)
        if not isinstance(job_id, str) or not isinstance(cursor, int):
            raise ValueError("the cursor or job id is not valid")
        if project is not None and not isinstance(project, str):
            raise ValueError("the project is not valid")
        return FiredEvent.from_pending(
            fire,
            cursor=cursor,
            job_id=escape_text(job_id),
            project=None if project is None else escape_text(project),
        )
    except (ValueError, TypeError) as exc:
        raise ValueError(f"not a valid event: {exc}") from None


def _lenient(read: Callable[[], _R], message: str, *args: object) -> _R | None:
    try:
        return read()
    except ValueError as exc:
        logger.error(message + " (%s); skipped", *args, exc)
        return None


def job_or_none(job_id: str, data: object) -> CronJob | None:
    """:func:`job_of`, or ``None`` (logged) for an unreadable row."""
    return _lenient(lambda: job_of(job_id, data), "cron store: the record of job %s is unreadable", job_id)


def pending_or_none(text: object, job_id: str) -> PendingFire | None:
    """:func:`pending_of`, or ``None`` (logged) for an unreadable column."""
    return _lenient(lambda: pending_of(text), "cron store: the pending fire of job %s is unreadable", job_id)


def watch_state_or_none(text: object, job_id: str) -> StoredWatch | None:
    """:func:`watch_state_of`, or ``None`` (logged) for an unreadable column."""
    return _lenient(
        lambda: watch_state_of(text), "cron store: the watch state of job %s is unreadable", job_id
    )


def event_or_none(row: tuple[Any, ...]) -> FiredEvent | None:
    """:func:`event_of`, or ``None`` (logged) for an unreadable row."""
    return _lenient(lambda: event_of(row), "cron store: event %s is unreadable", row[0] if row else "?")
