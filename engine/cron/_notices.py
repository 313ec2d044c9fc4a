"""Exit notices of subprocesses (``create(..., notify_on_exit=True)``): kept in the store, then delivered as
cron's fires are.

A notice is a fire without a job: ``job_id`` is ``"subprocess:<first pid>"``. It follows the same path
as an on-exit job's fire (``_delivery``): first **persisted** (a row of the ``notices`` table, schema
version 4), then **recorded** (appended to the event log, in the transaction that deletes its row:
standalone acknowledged, so delivered exactly once; embedded unacknowledged, handed to ``on_fire`` and
acknowledged after, so delivered at least once, deduplicated by ``fire_id``). A notice persisted by an
engine that stopped before recording it is recorded by the next engine at its start.

A store without the notices table (a store class that does not implement :class:`NoticeStore`) cannot keep
notices: the engine logs that and sends none.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Protocol, runtime_checkable

from ._events import FiredEvent, PendingFire
from ._rows import pending_or_none

__all__ = ["NoticeStore", "add_notice", "add_notices_table", "pending_notices", "take_notice"]


@runtime_checkable
class NoticeStore(Protocol):
    """What a job store offers to keep exit notices (``SqliteJobStore`` does).

    Every method is a checkpoint and atomic, as the :class:`~engine.cron.JobStore`'s.
    """

    async def add_notice(self, job_id: str, project: str | None, fire: PendingFire) -> None:
        """Persist a notice (its ``fire_id`` must be new)."""

    async def record_notice(self, fire_id: str, *, acked: bool) -> FiredEvent | None:
        """In one transaction, append the notice's fire to the event log (unless its ``fire_id`` is there)
        with ``acked`` as given, and delete the notice; ``None`` when no such notice is kept."""
        ...

    async def pending_notices(self) -> list[str]:
        """The fire ids of the notices persisted and not recorded yet, oldest first."""
        ...


def add_notices_table(conn: sqlite3.Connection) -> None:
    """3 -> 4: the ``notices`` table (``fire_id``, ``job_id``, ``project``, ``fire`` as JSON)."""
    conn.execute(
        """CREATE TABLE notices (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,
            fire_id TEXT NOT NULL UNIQUE,
            job_id TEXT NOT NULL,
            project TEXT,
            fire TEXT NOT NULL
        )"""
    )


def add_notice(conn: sqlite3.Connection, job_id: str, project: str | None, fire: PendingFire) -> None:
    """Insert a notice row (inside the caller's transaction)."""
    conn.execute(
        "INSERT INTO notices (fire_id, job_id, project, fire) VALUES (?, ?, ?, ?)",
        (fire.fire_id, job_id, project, json.dumps(fire.to_dict())),
    )


def take_notice(conn: sqlite3.Connection, fire_id: str) -> tuple[str, str | None, PendingFire] | None:
    """Delete the notice ``fire_id`` (inside the caller's transaction) and return its job id, project and
    fire; ``None`` when it is not kept, or its row is unreadable (then it is deleted and logged)."""
    row = conn.execute("SELECT job_id, project, fire FROM notices WHERE fire_id = ?", (fire_id,)).fetchone()
    if row is None:
        return None
    conn.execute("DELETE FROM notices WHERE fire_id = ?", (fire_id,))
    fire = pending_or_none(row[2], str(row[0]))
    return None if fire is None else (str(row[0]), row[1], fire)


def pending_notices(conn: sqlite3.Connection) -> list[str]:
    """The fire ids of the kept notices, oldest first."""
    return [str(row[0]) for row in conn.execute("SELECT fire_id FROM notices ORDER BY seq").fetchall()]
