"""The durable job store: the ``JobStore`` protocol and its SQLite implementation.

``<state_dir>/cron.sqlite3`` in WAL mode with ``synchronous=FULL``, one connection used from worker
threads one call at a time (``trio.to_thread.run_sync`` behind a ``CapacityLimiter(1)``). Every write is
one transaction: it commits as a whole or, raising :class:`StoreError`, leaves nothing behind. A row
that cannot be read is logged and skipped, so one bad record never hides the others; at :meth:`open`
such a row, or a damaged file, stops the start-up with a clear error instead (``_store_check``), and text
the engine would not let in today is shown escaped (``_rows``).

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
from collections.abc import Callable, Collection, Iterable, Mapping
from datetime import datetime
from typing import Any, TypeVar

import attrs
import trio

from .._errors import EngineError, JobNotFoundError, StoreError
from ._claims import Claim, DueClaims, due_at, take_due
from ._events import PENDING_FIRE_FIELDS, FiredEvent, PendingFire
from ._fleet import FleetMember, LocalBeats
from ._job import CronJob
from ._notices import add_notice, pending_notices, take_notice
from ._prepared import ClaimsAhead, TakenClaim, fire_row
from ._protocol import JobChange, JobStore
from ._rows import (
    EVENT_COLUMNS,
    event_or_none,
    job_or_none,
    pending_or_none,
    watch_state_or_none,
)
from ._store_check import connect_checked
from ._watch_state import StoredWatch

# JobStore re-exported
__all__ = [
    "PREPARE_AHEAD_SECONDS",
    "SQLITE_CLAIM_BATCH",
    "STORE_FILE_NAME",
    "JobChange",
    "JobStore",
    "SqliteJobStore",
]

logger = logging.getLogger("engine.cron")

STORE_FILE_NAME = "cron.sqlite3"
#: The most due times one claim transaction takes here (the timer asks again at once for the rest).
#: Five times the fleet's ``CLAIM_BATCH``: no other engine shares a SQLite store, so a large batch takes
#: nothing from anyone, and each claim scans every row, so 1000 due together cost one scan and one commit
#: rather than five (``docs/benchmarks/analysis.md``: p99 lateness of a burst of 1000, 34-43 ms over bare
#: against 45-72 ms with 200). It bounds one transaction to about 50 ms of store-thread time.
SQLITE_CLAIM_BATCH = 1000

#: How long before a due time the timer asks this store to make its claims ahead (``prepare_claims``,
#: ``_prepared``): long enough for a burst's thousand (about 30 ms of the store's thread), short enough
#: that a job changed meanwhile is rare (its claim is then made afresh).
PREPARE_AHEAD_SECONDS = 2.0

_T = TypeVar("_T")

#: The most fire ids one ``IN (...)`` query names (SQLite allows 32766 parameters).
_IN_CHUNK = 500
#: Appends one event: its job, project, the fire's fields and whether it is acknowledged.
_INSERT_EVENT = (
    f"INSERT INTO events (job_id, project, {', '.join(PENDING_FIRE_FIELDS)}, acked) "
    f"VALUES (?, ?{', ?' * len(PENDING_FIRE_FIELDS)}, ?)"
)
#: Where ``fire_id`` is among ``EVENT_COLUMNS``.
_FIRE_ID_COLUMN = EVENT_COLUMNS.split(", ").index("fire_id")


@attrs.define(eq=False)
class SqliteJobStore:
    """A :class:`JobStore` in one SQLite file.

    Args:
        path: the database file (``<state_dir>/cron.sqlite3``; see :meth:`in_state_dir`).
        connection_factory: the ``sqlite3.Connection`` class to use (tests pass one that fails on purpose).
        repair: at :meth:`open`, repair a damaged store (keep every readable row in a new file, move the
            damaged one aside) instead of refusing it (``EngineConfig.repair_store``).
        owner_lost_seconds: the heartbeat age past which ``fleet`` shows the engine as lost.
        prepare_ahead_seconds: how long before a due time the timer calls :meth:`prepare_claims`
            (:data:`PREPARE_AHEAD_SECONDS`; 0: never).
    """

    path: str
    connection_factory: type[sqlite3.Connection] = sqlite3.Connection
    repair: bool = attrs.field(default=False, kw_only=True)
    owner_lost_seconds: float = attrs.field(default=60.0, kw_only=True)
    prepare_ahead_seconds: float = attrs.field(default=PREPARE_AHEAD_SECONDS, kw_only=True)
    _beats: LocalBeats = attrs.field(
        init=False, default=attrs.Factory(lambda self: LocalBeats(self.owner_lost_seconds), takes_self=True)
    )
    _conn: sqlite3.Connection | None = attrs.field(init=False, default=None)
    _limiter: trio.CapacityLimiter = attrs.field(init=False, factory=lambda: trio.CapacityLimiter(1))
    _parsed: dict[str, tuple[str, CronJob]] = attrs.field(init=False, factory=dict)
    _ahead: ClaimsAhead = attrs.field(init=False, factory=lambda: ClaimsAhead(SQLITE_CLAIM_BATCH))

    @classmethod
    def in_state_dir(
        cls, state_dir: str, *, repair: bool = False, owner_lost_seconds: float = 60.0
    ) -> SqliteJobStore:
        """The store of a state directory: ``<state_dir>/cron.sqlite3``."""
        path = os.path.join(state_dir, STORE_FILE_NAME)
        return cls(path, repair=repair, owner_lost_seconds=owner_lost_seconds)

    def describe(self) -> str:
        """``sqlite:<path>``."""
        return f"sqlite:{self.path}"

    def owns(self, job: CronJob) -> bool:
        """``True``: the one engine of a SQLite store runs every job, whatever its ``owner``."""
        return True

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
        """Open (creating or migrating) the database, after checking it is ours and whole.

        The file and its ``-wal``/``-shm`` must be regular files of the engine's user (never links);
        a store that would lose something if opened (a write-ahead log damaged before a committed
        transaction, a truncated or broken file, a row that cannot be read) is refused, or repaired when
        :attr:`repair` is set (``_store_check``).

        Cancellation: the opening runs to its end; the cancellation is delivered after it.

        Raises:
            StoreError: the file cannot be opened, was written by a newer schema, or is damaged
                (``DamagedStoreError``: the message names the file and ``--repair``).
            UntrustedPathError: a file of the store is a link, another user's or writable by others.
        """

        def connect(path: str) -> sqlite3.Connection:
            return sqlite3.connect(
                path, factory=self.connection_factory, check_same_thread=False, isolation_level=None
            )

        def open_checked() -> sqlite3.Connection:
            try:
                return connect_checked(self.path, connect, repair=self.repair)
            except StoreError:
                raise
            except OSError as exc:
                if isinstance(exc, EngineError):
                    raise
                raise StoreError(f"cannot open the job store {self.path!r}: {exc}") from exc

        self._conn = await trio.to_thread.run_sync(open_checked, limiter=self._limiter)

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

    def _job(self, job_id: str, data: Any) -> CronJob | None:
        """The job of a row's ``data`` (``job_or_none``), parsed once per text: a row read again unchanged
        (the timer looks at every job on each wake) costs a dictionary look-up, not a JSON parse.

        Called in the store's worker thread only (one call at a time)."""
        seen = self._parsed.get(job_id)
        if seen is not None and seen[0] == data:
            return seen[1]
        job = job_or_none(job_id, data)
        if job is None:
            self._parsed.pop(job_id, None)
        else:
            self._parsed[job_id] = (data, job)
        return job

    def _all_rows(self, conn: sqlite3.Connection) -> list[Any]:
        """Every job row (``id, data``), oldest first; the parsed jobs of rows gone (deleted by another
        connection, a repair) are forgotten."""
        rows = conn.execute("SELECT id, data FROM jobs ORDER BY seq").fetchall()
        if len(self._parsed) > len(rows):
            self._parsed = {r[0]: seen for r in rows if (seen := self._parsed.get(r[0])) is not None}
        return rows

    def _read(self, conn: sqlite3.Connection, job_id: str) -> tuple[CronJob, sqlite3.Row | tuple[Any, ...]]:
        row = conn.execute(
            "SELECT data, pending_fire, watch_state FROM jobs WHERE id = ?", (job_id,)
        ).fetchone()
        if row is None:
            self._parsed.pop(job_id, None)
            raise JobNotFoundError(f"job_id {job_id!r} names no cron job; list the jobs to see their ids")
        job = self._job(job_id, row[0])
        if job is None:
            raise JobNotFoundError(f"job_id {job_id!r} names a cron job whose record is unreadable")
        return job, row

    @staticmethod
    def _text(job: CronJob, before: CronJob) -> str:
        """The row text of ``job``, a change of ``before``."""
        if job.id != before.id or job.project != before.project or job.owner != before.owner:
            raise ValueError("a job change must keep the job's id and project, and its owner")
        return json.dumps(job.to_dict())

    @classmethod
    def _write(cls, conn: sqlite3.Connection, job: CronJob, before: CronJob) -> None:
        conn.execute("UPDATE jobs SET data = ? WHERE id = ?", (cls._text(job, before), job.id))

    async def list_jobs(self) -> list[CronJob]:
        """Every readable job, oldest first; unreadable rows are logged and skipped."""

        def run(conn: sqlite3.Connection) -> list[CronJob]:
            rows = self._all_rows(conn)
            return [job for job in (self._job(r[0], r[1]) for r in rows) if job is not None]

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
            pending = pending_or_none(row[1], job_id)
            event = None if pending is None else self._append(conn, job_id, row[2], pending, acked=acked)
            conn.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
            self._parsed.pop(job_id, None)
            return job_or_none(job_id, row[0]), event

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

    @classmethod
    def _append(
        cls, conn: sqlite3.Connection, job_id: str, project: str | None, fire: PendingFire, *, acked: bool
    ) -> FiredEvent:
        row = conn.execute(
            f"SELECT {EVENT_COLUMNS}, acked FROM events WHERE fire_id = ?", (fire.fire_id,)
        ).fetchone()
        return cls._append_unless_logged(conn, job_id, project, fire, row, acked=acked)

    @staticmethod
    def _logged(conn: sqlite3.Connection, fire_ids: list[str]) -> dict[str, Any]:
        """The event rows (``EVENT_COLUMNS``, ``acked``) already logged for ``fire_ids``, by fire id: one
        query for a claim's whole batch instead of one per fire."""
        found: dict[str, Any] = {}
        for start in range(0, len(fire_ids), _IN_CHUNK):
            chunk = fire_ids[start : start + _IN_CHUNK]
            marks = ", ".join("?" * len(chunk))
            query = f"SELECT {EVENT_COLUMNS}, acked FROM events WHERE fire_id IN ({marks})"
            found.update((row[_FIRE_ID_COLUMN], row) for row in conn.execute(query, chunk))
        return found

    @staticmethod
    def _append_unless_logged(
        conn: sqlite3.Connection,
        job_id: str,
        project: str | None,
        fire: PendingFire,
        row: Any,
        *,
        acked: bool,
    ) -> FiredEvent:
        """Append ``fire``, or (``row``: its event as logged already) return that event, acked if asked."""
        if row is not None:
            event = event_or_none(row[:-1])
            if event is None:
                raise StoreError(f"the logged event of fire {fire.fire_id!r} is unreadable")
            if acked and not row[-1]:
                conn.execute("UPDATE events SET acked = 1 WHERE cursor = ?", (event.cursor,))
            return event
        values = [getattr(fire, name) for name in PENDING_FIRE_FIELDS]
        cur = conn.execute(_INSERT_EVENT, (job_id, project, *values, int(acked)))
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
                pending = pending_or_none(row[0], job_id)
                if pending is None or pending.fire_id == event.fire_id:
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

    # -- exit notices (engine.cron._notices) ---------------------------------------------------------

    async def add_notice(self, job_id: str, project: str | None, fire: PendingFire) -> None:
        """Persist a subprocess's exit notice before it is recorded (``_notices``)."""
        await self._call(lambda conn: add_notice(conn, job_id, project, fire), write=True)

    async def record_notice(self, fire_id: str, *, acked: bool) -> FiredEvent | None:
        """Append the notice's fire to the event log (deduplicated by ``fire_id``) and delete the notice,
        atomically; ``None`` when no such notice is kept."""

        def run(conn: sqlite3.Connection) -> FiredEvent | None:
            taken = take_notice(conn, fire_id)
            if taken is None:
                return None
            job_id, project, fire = taken
            return self._append(conn, job_id, project, fire, acked=acked)

        return await self._call(run, write=True)

    async def pending_notices(self) -> list[str]:
        """The fire ids of the notices persisted and not recorded yet, oldest first."""
        return await self._call(pending_notices, write=False)

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
                f"SELECT {EVENT_COLUMNS} FROM events WHERE acked = 0 ORDER BY cursor"
            ).fetchall()
            return [e for e in (event_or_none(r) for r in rows) if e is not None]

        return await self._call(run, write=False)

    async def pending_fires(self) -> list[tuple[CronJob, PendingFire]]:
        """Every readable job with a committed, undelivered fire, and that fire, oldest job first."""

        def run(conn: sqlite3.Connection) -> list[tuple[CronJob, PendingFire]]:
            rows = conn.execute(
                "SELECT id, data, pending_fire FROM jobs WHERE pending_fire IS NOT NULL ORDER BY seq"
            ).fetchall()
            found = []
            for job_id, data, text in rows:
                job = self._job(job_id, data)
                fire = pending_or_none(text, job_id)
                if job is not None and fire is not None:
                    found.append((job, fire))
            return found

        return await self._call(run, write=False)

    async def set_watch_state(self, job_id: str, state: StoredWatch | None) -> None:
        """Set (``None``: clear) the watch state of job ``job_id``.

        Raises:
            JobNotFoundError: no such job.
        """
        if await self.set_watch_states({job_id: state}):
            raise JobNotFoundError(f"job_id {job_id!r} names no cron job")

    async def set_watch_states(self, states: Mapping[str, StoredWatch | None]) -> frozenset[str]:
        """Set (``None``: clear) the watch state of each job in ``states``, in one transaction; return the
        ids that name no job (the others are set)."""
        rows = [
            (None if state is None else json.dumps(state.to_dict()), job_id)
            for job_id, state in states.items()
        ]

        def run(conn: sqlite3.Connection) -> frozenset[str]:
            missing = [
                job_id
                for text, job_id in rows
                if conn.execute("UPDATE jobs SET watch_state = ? WHERE id = ?", (text, job_id)).rowcount == 0
            ]
            return frozenset(missing)

        return await self._call(run, write=True)

    async def watch_states(self) -> dict[str, StoredWatch]:
        """Every job's watch state, by job id (unreadable ones skipped)."""

        def run(conn: sqlite3.Connection) -> dict[str, StoredWatch]:
            rows = conn.execute("SELECT id, watch_state FROM jobs WHERE watch_state IS NOT NULL").fetchall()
            states = {job_id: watch_state_or_none(text, job_id) for job_id, text in rows}
            return {k: v for k, v in states.items() if v is not None}

        return await self._call(run, write=False)

    async def events(self, since: int = 0) -> list[FiredEvent]:
        """The logged events with ``cursor > since``, oldest first (unreadable ones skipped)."""

        def run(conn: sqlite3.Connection) -> list[FiredEvent]:
            rows = conn.execute(
                f"SELECT {EVENT_COLUMNS} FROM events WHERE cursor > ? ORDER BY cursor", (since,)
            ).fetchall()
            return [e for e in (event_or_none(r) for r in rows) if e is not None]

        return await self._call(run, write=False)

    # -- the timer's claim, and the fleet's parts of the protocol ------------------------------------

    async def claim_due(
        self, now: datetime, *, skip: Collection[str] = (), acked: bool, limit: int = SQLITE_CLAIM_BATCH
    ) -> DueClaims:
        """Claim every due job (not in ``skip``) at ``now``, oldest due first, in one transaction
        (``_claims``), at most ``limit`` of them (:data:`SQLITE_CLAIM_BATCH`); log each ``SystemEvent``
        fire with it (``acked`` as given). A claim :meth:`prepare_claims` made for the very job read here
        is used when ``now`` allows it (``_prepared.ClaimsAhead``); the others are made here."""
        skipped = set(skip)

        def run(conn: sqlite3.Connection) -> DueClaims:
            rows = self._all_rows(conn)
            jobs = [j for j in (self._job(r[0], r[1]) for r in rows) if j is not None and j.id not in skipped]
            due = sorted((j for j in jobs if (at := due_at(j)) is not None and at <= now), key=_due_order)
            taken: list[TakenClaim] = []
            for job in due[:limit]:
                made = self._ahead.take(job, now)
                if made is None:
                    fresh = take_due(job, now)
                    if fresh is None:
                        continue
                    after, fire = fresh
                    row = None if fire is None else fire_row(job, fire)
                    made = (job, after, self._text(after, job), fire, row)
                taken.append(made)
            conn.executemany("UPDATE jobs SET data = ? WHERE id = ?", [(t[2], t[1].id) for t in taken])
            fire_ids = [fire.fire_id for *_, fire, _row in taken if fire is not None]
            logged = self._logged(conn, fire_ids) if fire_ids else {}
            claims = []
            for job, after, text, fire, row in taken:
                # Kept parsed: ``after`` is the claim of a job read (and escaped) here, so it is what
                # reading the text back gives (a rollback leaves other text, which is parsed again).
                self._parsed[after.id] = (text, after)
                event = None
                if fire is not None and row is not None:
                    event = self._append_claimed(conn, job, fire, row, logged.get(fire.fire_id), acked=acked)
                claims.append(Claim(after, event))
            claimed = {c.job.id: c.job for c in claims}
            waiting = [due_at(claimed.get(j.id, j)) for j in jobs]
            next_due = min((at for at in waiting if at is not None), default=None)
            return DueClaims(claims, now, next_due, full=len(due) > limit)

        return await self._call(run, write=True)

    @classmethod
    def _append_claimed(
        cls,
        conn: sqlite3.Connection,
        job: CronJob,
        fire: PendingFire,
        row: tuple[object, ...],
        logged: Any,
        *,
        acked: bool,
    ) -> FiredEvent:
        """Append a claimed job's ``fire`` (``row``: its columns, ``_prepared.fire_row``), or (``logged``: its
        event's row) return the event logged already."""
        if logged is not None:
            return cls._append_unless_logged(conn, job.id, job.project, fire, logged, acked=acked)
        cur = conn.execute(_INSERT_EVENT, (*row, int(acked)))
        assert cur.lastrowid is not None
        return FiredEvent.logged(row, cursor=cur.lastrowid)

    async def prepare_claims(self, until: datetime) -> None:
        """Make ahead the claims of the jobs due by ``until``, at most :data:`SQLITE_CLAIM_BATCH` of them,
        earliest first, for :meth:`claim_due` (``_prepared``).

        Nothing is written. The jobs are those of the last look (:meth:`claim_due`); a claim made for a
        job that changed since is never used. Runs in the store's thread, outside any transaction.
        """

        def run() -> None:
            self._ahead.prepare((job for _data, job in self._parsed.values()), until)

        await self._call(lambda _conn: run(), write=False)

    async def listen(
        self,
        on_jobs: Callable[[], None],
        on_events: Callable[[], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Nothing to hear: only this engine writes a SQLite store. Sleeps until cancelled."""
        task_status.started()
        await trio.sleep_forever()

    async def beat(self, member: FleetMember) -> None:
        """Keep this engine's heartbeat in memory (one engine per SQLite store)."""
        await self._beats.beat(member)

    async def fleet(self) -> list[FleetMember]:
        """This engine's last heartbeat and its age."""
        return await self._beats.fleet()


def _due_order(job: CronJob) -> tuple[datetime, datetime]:
    assert job.next_run_at is not None
    return job.next_run_at, job.created_at
