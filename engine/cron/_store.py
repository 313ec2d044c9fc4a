"""The durable job store: the ``JobStore`` protocol and its SQLite implementation.

``<state_dir>/cron.sqlite3`` in WAL mode with ``synchronous=FULL``, one connection used from worker
threads one call at a time (``trio.to_thread.run_sync`` behind a ``CapacityLimiter(1)``). Every write is
one transaction: it commits as a whole or, raising :class:`StoreError`, leaves nothing behind. A row
that cannot be read is logged and skipped, so one bad record never hides the others.

Two columns serve the exit watchers: ``pending_fire`` (a committed fire not yet recorded in the event log,
see ``_events``) and ``watch_state`` (whatever a watcher needs to find its command again after a restart).
``project`` holds the job's project id (``CronJob.project``, which never changes) next to its record, and
every event of the job is logged with it.

Each event carries ``acked``: whether its delivery is acknowledged. A standalone engine's events are acked
as they are appended (the log is the delivery); an embedded engine's once ``on_fire`` returned. An event
is only appended for a job that still exists, in the transaction that clears the job's pending fire.

The schema and its numbered versions are in ``_migrations``: opening the store brings an older file up to
date, one step per transaction, and refuses a newer one.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import attrs
import trio

from .._errors import JobNotFoundError, StoreError
from ._events import PENDING_FIRE_FIELDS, FiredEvent, PendingFire
from ._job import CronJob
from ._migrations import migrate
from ._protocol import JobChange, JobStore
from ._watch_state import WatchState

__all__ = ["STORE_FILE_NAME", "JobChange", "JobStore", "SqliteJobStore"]  # JobStore re-exported

logger = logging.getLogger("engine.cron")

STORE_FILE_NAME = "cron.sqlite3"

_T = TypeVar("_T")
_R = TypeVar("_R")

#: The columns of an event as :func:`_event_from_row` reads them.
_EVENT_COLUMNS = "cursor, job_id, project, " + ", ".join(PENDING_FIRE_FIELDS)


def _loads(text: str | None, what: str, job_id: str) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        logger.error("cron store: the %s of job %s is unreadable; skipped", what, job_id)
        return None
    return value


def _record_from_text(
    text: str | None, what: str, job_id: str, parse: Callable[[dict[str, Any]], _R]
) -> _R | None:
    """The record in a JSON column (``parse`` reads it), or ``None``; an unreadable one is logged."""
    data = _loads(text, what, job_id)
    if data is None:
        return None
    try:
        return parse(data)
    except ValueError as exc:
        logger.error("cron store: the %s of job %s is unreadable (%s); skipped", what, job_id, exc)
        return None


def _pending_from_text(text: str | None, job_id: str) -> PendingFire | None:
    return _record_from_text(text, "pending fire", job_id, PendingFire.from_dict)


def _watch_state_from_text(text: str | None, job_id: str) -> WatchState | None:
    return _record_from_text(text, "watch state", job_id, WatchState.from_dict)


@attrs.define(eq=False)
class SqliteJobStore:
    """A :class:`JobStore` in one SQLite file.

    Args:
        path: the database file (``<state_dir>/cron.sqlite3``; see :meth:`in_state_dir`).
        connection_factory: the ``sqlite3.Connection`` class to use (tests pass one that fails on purpose).
    """

    path: str
    connection_factory: type[sqlite3.Connection] = sqlite3.Connection
    _conn: sqlite3.Connection | None = attrs.field(init=False, default=None)
    _limiter: trio.CapacityLimiter = attrs.field(init=False, factory=lambda: trio.CapacityLimiter(1))

    @classmethod
    def in_state_dir(cls, state_dir: str) -> SqliteJobStore:
        """The store of a state directory: ``<state_dir>/cron.sqlite3``."""
        return cls(os.path.join(state_dir, STORE_FILE_NAME))

    def describe(self) -> str:
        """``sqlite:<path>``."""
        return f"sqlite:{self.path}"

    def __repr__(self) -> str:
        return f"<SqliteJobStore {self.path!r}: {'open' if self._conn is not None else 'closed'}>"

    async def _call(self, fn: Callable[[sqlite3.Connection], _T], *, write: bool) -> _T:
        def run() -> _T:
            conn = self._conn
            if conn is None:
                raise StoreError(f"the job store {self.path!r} is closed")
            try:
                if not write:
                    return fn(conn)
                conn.execute("BEGIN IMMEDIATE")
                try:
                    result = fn(conn)
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        conn.rollback()
                    raise
                return result
            except (sqlite3.Error, OSError) as exc:
                if isinstance(exc, StoreError):
                    raise
                raise StoreError(f"job store {self.path!r}: {exc}") from exc

        return await trio.to_thread.run_sync(run, limiter=self._limiter)

    async def open(self) -> None:
        """Open (creating or migrating) the database.

        Cancellation: the opening runs to its end; the cancellation is delivered after it.

        Raises:
            StoreError: the file cannot be opened, or was written by a newer schema.
        """

        def connect() -> sqlite3.Connection:
            try:
                os.makedirs(os.path.dirname(self.path) or ".", mode=0o700, exist_ok=True)
                conn = sqlite3.connect(
                    self.path, factory=self.connection_factory, check_same_thread=False, isolation_level=None
                )
            except (sqlite3.Error, OSError) as exc:
                raise StoreError(f"cannot open the job store {self.path!r}: {exc}") from exc
            try:
                os.chmod(self.path, 0o600)
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=FULL")
                conn.execute("PRAGMA busy_timeout=5000")
                migrate(conn, self.path)
            except (sqlite3.Error, OSError) as exc:
                conn.close()
                if isinstance(exc, StoreError):
                    raise
                raise StoreError(f"cannot open the job store {self.path!r}: {exc}") from exc
            except BaseException:
                conn.close()
                raise
            return conn

        self._conn = await trio.to_thread.run_sync(connect, limiter=self._limiter)

    async def aclose(self) -> None:
        """Close the connection (a no-op when closed).

        Cancellation: the close runs to its end; the cancellation is delivered after it.
        """

        def close() -> None:
            conn, self._conn = self._conn, None
            if conn is not None:
                conn.close()

        await trio.to_thread.run_sync(close, limiter=self._limiter)

    # -- jobs ---------------------------------------------------------------------------------------

    @staticmethod
    def _read(conn: sqlite3.Connection, job_id: str) -> tuple[CronJob, sqlite3.Row | tuple[Any, ...]]:
        row = conn.execute(
            "SELECT data, pending_fire, watch_state FROM jobs WHERE id = ?", (job_id,)
        ).fetchone()
        if row is None:
            raise JobNotFoundError(f"job_id {job_id!r} names no cron job; list the jobs to see their ids")
        job = _job_from_row(job_id, row[0])
        if job is None:
            raise JobNotFoundError(f"job_id {job_id!r} names a cron job whose record is unreadable")
        return job, row

    @staticmethod
    def _write(conn: sqlite3.Connection, job: CronJob, before: CronJob) -> None:
        if job.id != before.id or job.project != before.project:
            raise ValueError("a job change must keep the job's id and project")
        conn.execute("UPDATE jobs SET data = ? WHERE id = ?", (json.dumps(job.to_dict()), job.id))

    async def list_jobs(self) -> list[CronJob]:
        """Every readable job, oldest first; unreadable rows are logged and skipped."""

        def run(conn: sqlite3.Connection) -> list[CronJob]:
            rows = conn.execute("SELECT id, data FROM jobs ORDER BY seq").fetchall()
            return [job for job in (_job_from_row(r[0], r[1]) for r in rows) if job is not None]

        return await self._call(run, write=False)

    async def get_job(self, job_id: str) -> CronJob:
        """The job ``job_id``.

        Raises:
            JobNotFoundError: no such job (or its row is unreadable).
        """
        return await self._call(lambda conn: self._read(conn, job_id)[0], write=False)

    async def insert_job(self, job: CronJob) -> None:
        """Add ``job``.

        Raises:
            StoreError: the write failed, or the id exists.
        """

        def run(conn: sqlite3.Connection) -> None:
            conn.execute(
                "INSERT INTO jobs (id, data, project) VALUES (?, ?, ?)",
                (job.id, json.dumps(job.to_dict()), job.project),
            )

        await self._call(run, write=True)

    async def update_job(self, job_id: str, change: JobChange) -> CronJob:
        """Replace job ``job_id`` by ``change(job)`` in one transaction; return the new job."""

        def run(conn: sqlite3.Connection) -> CronJob:
            before, _ = self._read(conn, job_id)
            after = change(before)
            self._write(conn, after, before)
            return after

        return await self._call(run, write=True)

    async def delete_job(
        self, job_id: str, *, acked: bool = True
    ) -> tuple[CronJob | None, FiredEvent | None]:
        """Delete job ``job_id`` (an unreadable row too); return it and the event of its pending fire.

        A fire the job committed but had not recorded yet is appended to the event log in the same
        transaction (``acked`` as given: ``False`` when ``on_fire`` is still to see it), so removing a
        job never loses a fire that happened before.

        Raises:
            JobNotFoundError: no such job.
        """

        def run(conn: sqlite3.Connection) -> tuple[CronJob | None, FiredEvent | None]:
            row = conn.execute(
                "SELECT data, pending_fire, project FROM jobs WHERE id = ?", (job_id,)
            ).fetchone()
            if row is None:
                raise JobNotFoundError(f"job_id {job_id!r} names no cron job; list the jobs to see their ids")
            pending = _pending_from_text(row[1], job_id)
            event = None if pending is None else self._append(conn, job_id, row[2], pending, acked=acked)
            conn.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
            return _job_from_row(job_id, row[0]), event

        return await self._call(run, write=True)

    async def commit_fire(self, job_id: str, change: JobChange, pending_fire: PendingFire) -> CronJob:
        """Replace the job by ``change(job)`` and set its ``pending_fire``, in one transaction."""
        text = json.dumps(pending_fire.to_dict())

        def run(conn: sqlite3.Connection) -> CronJob:
            before, _ = self._read(conn, job_id)
            after = change(before)
            self._write(conn, after, before)
            conn.execute("UPDATE jobs SET pending_fire = ? WHERE id = ?", (text, job_id))
            return after

        return await self._call(run, write=True)

    # -- events -------------------------------------------------------------------------------------

    @staticmethod
    def _append(
        conn: sqlite3.Connection, job_id: str, project: str | None, fire: PendingFire, *, acked: bool
    ) -> FiredEvent:
        row = conn.execute(
            f"SELECT {_EVENT_COLUMNS}, acked FROM events WHERE fire_id = ?", (fire.fire_id,)
        ).fetchone()
        if row is not None:
            event = _event_from_row(row[:-1])
            if event is None:
                raise StoreError(f"the logged event of fire {fire.fire_id!r} is unreadable")
            if acked and not row[-1]:
                conn.execute("UPDATE events SET acked = 1 WHERE cursor = ?", (event.cursor,))
            return event
        values = [getattr(fire, name) for name in PENDING_FIRE_FIELDS]
        cur = conn.execute(
            f"INSERT INTO events (job_id, project, {', '.join(PENDING_FIRE_FIELDS)}, acked) "
            f"VALUES (?, ?{', ?' * len(values)}, ?)",
            (job_id, project, *values, int(acked)),
        )
        assert cur.lastrowid is not None
        return FiredEvent.from_pending(fire, cursor=cur.lastrowid, job_id=job_id, project=project)

    def _record(
        self, job_id: str, fire: PendingFire, *, acked: bool
    ) -> Callable[[sqlite3.Connection], FiredEvent]:
        def run(conn: sqlite3.Connection) -> FiredEvent:
            row = conn.execute("SELECT pending_fire, project FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None:
                raise JobNotFoundError(
                    f"job_id {job_id!r} names no cron job; its fire {fire.fire_id!r} is not logged"
                )
            event = self._append(conn, job_id, row[1], fire, acked=acked)
            if row[0] is not None:  # clear the job's pending fire if it is this one (or unreadable)
                pending = _loads(row[0], "pending fire", job_id)
                if pending is None or pending.get("fire_id") == event.fire_id:
                    conn.execute("UPDATE jobs SET pending_fire = NULL WHERE id = ?", (job_id,))
            return event

        return run

    async def record_event(self, job_id: str, fire: PendingFire) -> FiredEvent:
        """Append ``fire`` unacknowledged and clear the job's pending fire if it is this one, atomically.

        An event already logged with this ``fire_id`` is returned as it is (acked or not). The embedded
        delivery: :meth:`ack_events` once ``on_fire`` returned.

        Raises:
            JobNotFoundError: the job is gone; nothing is appended.
        """
        return await self._call(self._record(job_id, fire, acked=False), write=True)

    async def deliver_fire(self, job_id: str, fire: PendingFire) -> FiredEvent:
        """Append ``fire`` acknowledged (deduplicated by ``fire_id``), clearing the pending fire, at once.

        The standalone delivery: exactly once.

        Raises:
            JobNotFoundError: the job is gone; nothing is appended.
        """
        return await self._call(self._record(job_id, fire, acked=True), write=True)

    async def ack_events(self, cursors: Iterable[int]) -> None:
        """Mark the events at ``cursors`` delivered (unknown cursors are ignored)."""
        rows = [(cursor,) for cursor in cursors]

        def run(conn: sqlite3.Connection) -> None:
            conn.executemany("UPDATE events SET acked = 1 WHERE cursor = ?", rows)

        await self._call(run, write=True)

    async def unacked_events(self) -> list[FiredEvent]:
        """The events whose delivery is not acknowledged, in cursor order (unreadable ones skipped)."""

        def run(conn: sqlite3.Connection) -> list[FiredEvent]:
            rows = conn.execute(
                f"SELECT {_EVENT_COLUMNS} FROM events WHERE acked = 0 ORDER BY cursor"
            ).fetchall()
            return [e for e in (_event_from_row(r) for r in rows) if e is not None]

        return await self._call(run, write=False)

    async def pending_fires(self) -> list[tuple[CronJob, PendingFire]]:
        """Every readable job with a committed, undelivered fire, and that fire, oldest job first."""

        def run(conn: sqlite3.Connection) -> list[tuple[CronJob, PendingFire]]:
            rows = conn.execute(
                "SELECT id, data, pending_fire FROM jobs WHERE pending_fire IS NOT NULL ORDER BY seq"
            ).fetchall()
            found = []
            for job_id, data, text in rows:
                job = _job_from_row(job_id, data)
                fire = _pending_from_text(text, job_id)
                if job is not None and fire is not None:
                    found.append((job, fire))
            return found

        return await self._call(run, write=False)

    async def set_watch_state(self, job_id: str, state: WatchState | None) -> None:
        """Set (``None``: clear) the watch state of job ``job_id``.

        Raises:
            JobNotFoundError: no such job.
        """
        text = None if state is None else json.dumps(state.to_dict())

        def run(conn: sqlite3.Connection) -> None:
            if conn.execute("UPDATE jobs SET watch_state = ? WHERE id = ?", (text, job_id)).rowcount == 0:
                raise JobNotFoundError(f"job_id {job_id!r} names no cron job")

        await self._call(run, write=True)

    async def watch_states(self) -> dict[str, WatchState]:
        """Every job's watch state, by job id (unreadable ones skipped)."""

        def run(conn: sqlite3.Connection) -> dict[str, WatchState]:
            rows = conn.execute("SELECT id, watch_state FROM jobs WHERE watch_state IS NOT NULL").fetchall()
            states = {job_id: _watch_state_from_text(text, job_id) for job_id, text in rows}
            return {k: v for k, v in states.items() if v is not None}

        return await self._call(run, write=False)

    async def events(self, since: int = 0) -> list[FiredEvent]:
        """The logged events with ``cursor > since``, oldest first (unreadable ones skipped)."""

        def run(conn: sqlite3.Connection) -> list[FiredEvent]:
            rows = conn.execute(
                f"SELECT {_EVENT_COLUMNS} FROM events WHERE cursor > ? ORDER BY cursor", (since,)
            ).fetchall()
            return [e for e in (_event_from_row(r) for r in rows) if e is not None]

        return await self._call(run, write=False)


def _job_from_row(job_id: str, data: str) -> CronJob | None:
    try:
        job = CronJob.from_dict(json.loads(data))
        if job.id != job_id:
            raise ValueError(f"the record holds id {job.id!r}")
        return job
    except ValueError as exc:
        logger.error("cron store: the record of job %s is unreadable (%s); skipped", job_id, exc)
        return None


def _event_from_row(row: tuple[Any, ...]) -> FiredEvent | None:
    cursor, job_id, project, *rest = row
    fields = dict(zip(PENDING_FIRE_FIELDS, rest, strict=True))
    fields["truncated"] = bool(fields["truncated"])
    try:
        return FiredEvent.from_pending(
            PendingFire.from_dict(fields), cursor=cursor, job_id=job_id, project=project
        )
    except ValueError as exc:
        logger.error("cron store: event %s is unreadable (%s); skipped", cursor, exc)
        return None
