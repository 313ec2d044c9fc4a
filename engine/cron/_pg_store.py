"""The fleet store: the ``JobStore`` protocol in PostgreSQL, shared by every engine of a fleet.

Engines on many machines share one database (``EngineConfig.store_url``): one place for the jobs and
one event log. What floats and what stays (``_claims``): a timed ``SystemEvent`` job may be fired by any
engine; ``Command`` jobs and on-exit jobs are run only by their owner, the engine that added them
(``owns``), and their watch states and pending fires are its alone.

- **Claims** (:meth:`PostgresJobStore.claim_due`): the due jobs this engine may run are locked with
  ``FOR UPDATE SKIP LOCKED`` (engines claiming at once take different jobs and never wait on each
  other), claimed at the database's ``now()`` and, for a ``SystemEvent``, their event is appended in
  the same transaction with a ``fire_id`` fixed by the due time and unique in the log: one event per due
  time, whichever engine commits it, whatever engine dies before or during the transaction.
- **One event stream, never skipped**: every append holds a transaction-level advisory lock
  (``EVENTS_LOCK``) from before its insert to its commit, so cursors are given in commit order and a
  reader that saw cursor ``n`` never finds a smaller one committed later. Each append and each job
  change sends a ``NOTIFY`` (delivered at commit) that wakes followers and timers of the fleet
  (:meth:`listen`).
- **The clock** of due times and heartbeat ages is the database's, so engines need no skew setting.
- **Leases**: an embedded engine logs events unacknowledged and acks them once ``on_fire`` returned. An
  unacknowledged event of a floating job carries a lease of ``lease_seconds``; when it runs out (its
  engine died before ``on_fire`` returned) the next engine that catches up takes the event over.
- **A lost connection** fails the call with :class:`StoreError` (an ``OSError``: the callers retry with
  back-off, and nothing fires meanwhile: fail-closed); the next call connects again. A read that finds
  its connection broken connects once more and repeats at once.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import attrs
import trio

from .._errors import JobNotFoundError, StoreError
from .._retry import RetryPolicy
from ._claims import CLAIM_BATCH, Claim, DueClaims, due_at, floats, take_due
from ._events import PENDING_FIRE_FIELDS, FiredEvent, PendingFire
from ._fleet import FleetMember
from ._job import CronJob
from ._pg_conn import EVENTS_CHANNEL, JOBS_CHANNEL, Listener, connect, redact_error, redact_url
from ._pg_migrations import EVENTS_LOCK, migrate_pg
from ._rows import EVENT_COLUMNS, event_or_none, job_or_none, pending_or_none, watch_state_or_none
from ._watch_state import StoredWatch

__all__ = ["PostgresJobStore"]

logger = logging.getLogger("engine.cron")

_T = TypeVar("_T")
#: How soon the timer looks again when due jobs were locked by another engine's claim, in seconds.
LOCKED_RECHECK_SECONDS = 0.5
_EVENTS = "gadget_events"
_NOT_FOUND = "names no cron job; list the jobs to see their ids"


@attrs.define(eq=False)
class PostgresJobStore:
    """A :class:`JobStore` in a PostgreSQL database shared by a fleet of engines.

    Args:
        url: ``postgresql://user[:password]@host[:port]/db`` (libpq's URL; a password may also come from
            ``PGPASSWORD`` or a ``.pgpass`` file).
        engine_id: this engine's id: the owner of the jobs it adds, the author of its heartbeats.
        lease_seconds: how long an unacknowledged event of a floating job stays with the engine that
            logged it before another may take it over.
        owner_lost_seconds: the heartbeat age past which an engine counts as lost.
    """

    url: str = attrs.field(repr=redact_url)
    engine_id: str
    lease_seconds: float = attrs.field(default=30.0, kw_only=True)
    owner_lost_seconds: float = attrs.field(default=60.0, kw_only=True)
    #: The timer never asks this store to prepare its claims (:meth:`prepare_claims`).
    prepare_ahead_seconds: float = attrs.field(init=False, default=0.0)
    _conn: Any = attrs.field(init=False, default=None, repr=False)
    _closed: bool = attrs.field(init=False, default=True)
    _limiter: trio.CapacityLimiter = attrs.field(init=False, factory=lambda: trio.CapacityLimiter(1))

    def describe(self) -> str:
        """The URL without its password."""
        return redact_url(self.url)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<PostgresJobStore {self.describe()!r} as {self.engine_id!r}: {state}>"

    def owns(self, job: CronJob) -> bool:
        """Whether ``job`` was added by this engine (only it runs its ``Command`` or on-exit command)."""
        return job.owner == self.engine_id

    # -- connection -----------------------------------------------------------------------------------

    def _connection(self) -> Any:
        if self._closed:
            raise StoreError(f"the job store {self.describe()} is closed")
        if self._conn is None or self._conn.closed or self._conn.broken:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            self._conn = connect(self.url)
        return self._conn

    async def _call(self, fn: Callable[[Any], _T], *, write: bool) -> _T:
        import psycopg

        def attempt() -> _T:
            conn = self._connection()
            if not write:
                with conn.cursor() as cur:
                    return fn(cur)
            with conn.transaction(), conn.cursor() as cur:
                return fn(cur)

        def run() -> _T:
            try:
                try:
                    return attempt()
                except psycopg.OperationalError:
                    if write or self._conn is None or not self._conn.broken:
                        raise
                    return attempt()  # a read on a connection lost while idle: once more, connected anew
            except psycopg.Error as exc:
                raise StoreError(f"job store {self.describe()}: {redact_error(exc, self.url)}") from None

        return await trio.to_thread.run_sync(run, limiter=self._limiter)

    async def open(self) -> None:
        """Connect and create or migrate the schema (``_pg_migrations``).

        Cancellation: the opening runs to its end; the cancellation is delivered after it.

        Raises:
            StoreError: the server cannot be reached, or its schema is newer than this engine's.
        """
        import psycopg

        def run() -> None:
            self._closed = False
            try:
                migrate_pg(self._connection(), self.describe())
            except psycopg.Error as exc:
                raise StoreError(f"job store {self.describe()}: {redact_error(exc, self.url)}") from None

        try:
            await trio.to_thread.run_sync(run, limiter=self._limiter)
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        """Close the connection (a no-op when closed). Cancellation: runs to its end."""

        def close() -> None:
            conn, self._conn, self._closed = self._conn, None, True
            if conn is not None:
                conn.close()

        await trio.to_thread.run_sync(close, limiter=self._limiter)

    # -- jobs -----------------------------------------------------------------------------------------

    def _read(self, cur: Any, job_id: str, *, lock: bool = True) -> tuple[CronJob, Any]:
        suffix = " FOR UPDATE" if lock else ""
        cur.execute(f"SELECT data, pending_fire, project FROM gadget_jobs WHERE id = %s{suffix}", (job_id,))
        row = cur.fetchone()
        if row is None:
            raise JobNotFoundError(f"job_id {job_id!r} {_NOT_FOUND}")
        job = job_or_none(job_id, row[0])
        if job is None:
            raise JobNotFoundError(f"job_id {job_id!r} names a cron job whose record is unreadable")
        return job, row

    @staticmethod
    def _write(cur: Any, job: CronJob, before: CronJob) -> None:
        if job.id != before.id or job.project != before.project or job.owner != before.owner:
            raise ValueError("a job change must keep the job's id and project, and its owner")
        cur.execute(
            "UPDATE gadget_jobs SET data = %s, due_at = %s WHERE id = %s",
            (json.dumps(job.to_dict()), due_at(job), job.id),
        )
        cur.execute(f"NOTIFY {JOBS_CHANNEL}")

    async def list_jobs(self) -> list[CronJob]:
        """Every readable job of the fleet, oldest first; unreadable rows are logged and skipped."""

        def run(cur: Any) -> list[CronJob]:
            rows = cur.execute("SELECT id, data FROM gadget_jobs ORDER BY seq").fetchall()
            return [job for job in (job_or_none(r[0], r[1]) for r in rows) if job is not None]

        return await self._call(run, write=False)

    async def get_job(self, job_id: str) -> CronJob:
        """The job ``job_id``. Raises: JobNotFoundError."""
        return await self._call(lambda cur: self._read(cur, job_id, lock=False)[0], write=False)

    async def insert_job(self, job: CronJob) -> None:
        """Add ``job`` (its ``owner`` as given). Raises: StoreError (the write failed, or the id exists)."""

        def run(cur: Any) -> None:
            cur.execute(
                "INSERT INTO gadget_jobs (id, data, project, owner, floats, due_at) "
                "VALUES (%s, %s, %s, %s, %s, %s)",
                (job.id, json.dumps(job.to_dict()), job.project, job.owner, floats(job), due_at(job)),
            )
            cur.execute(f"NOTIFY {JOBS_CHANNEL}")

        await self._call(run, write=True)

    async def update_job(self, job_id: str, change: Callable[[CronJob], CronJob]) -> CronJob:
        """Replace job ``job_id`` by ``change(job)`` in one transaction (the row locked); return it."""

        def run(cur: Any) -> CronJob:
            before, _ = self._read(cur, job_id)
            after = change(before)
            self._write(cur, after, before)
            return after

        return await self._call(run, write=True)

    async def delete_job(
        self, job_id: str, *, acked: bool = True
    ) -> tuple[CronJob | None, FiredEvent | None]:
        """Delete job ``job_id``, logging its pending fire (if any) in the same transaction."""

        def run(cur: Any) -> tuple[CronJob | None, FiredEvent | None]:
            cur.execute(
                "SELECT data, pending_fire, project FROM gadget_jobs WHERE id = %s FOR UPDATE", (job_id,)
            )
            row = cur.fetchone()
            if row is None:
                raise JobNotFoundError(f"job_id {job_id!r} {_NOT_FOUND}")
            job = job_or_none(job_id, row[0])
            pending = pending_or_none(row[1], job_id)
            event = None
            if pending is not None:
                event = self._append(
                    cur, job_id, row[2], pending, acked=acked, floating=job is not None and floats(job)
                )
            cur.execute("DELETE FROM gadget_jobs WHERE id = %s", (job_id,))
            cur.execute(f"NOTIFY {JOBS_CHANNEL}")
            return job, event

        return await self._call(run, write=True)

    async def commit_fire(
        self, job_id: str, change: Callable[[CronJob], CronJob], pending_fire: PendingFire
    ) -> CronJob:
        """Replace the job by ``change(job)`` and set its ``pending_fire``, in one transaction."""
        text = json.dumps(pending_fire.to_dict())

        def run(cur: Any) -> CronJob:
            before, _ = self._read(cur, job_id)
            after = change(before)
            self._write(cur, after, before)
            cur.execute("UPDATE gadget_jobs SET pending_fire = %s WHERE id = %s", (text, job_id))
            return after

        return await self._call(run, write=True)

    # -- events ---------------------------------------------------------------------------------------

    def _append(
        self, cur: Any, job_id: str, project: str | None, fire: PendingFire, *, acked: bool, floating: bool
    ) -> FiredEvent:
        """Append ``fire`` (unless its ``fire_id`` is logged), holding the append lock until commit."""
        cur.execute("SELECT pg_advisory_xact_lock(%s)", (EVENTS_LOCK,))
        values = [getattr(fire, name) for name in PENDING_FIRE_FIELDS]
        cur.execute(
            f"INSERT INTO {_EVENTS} (job_id, project, {', '.join(PENDING_FIRE_FIELDS)}, acked, engine_id, "
            f"floats, leased_until) VALUES (%s, %s{', %s' * len(values)}, %s, %s, %s, "
            "CASE WHEN %s THEN NULL ELSE now() + make_interval(secs => %s) END) "
            "ON CONFLICT (fire_id) DO NOTHING RETURNING cursor",
            (job_id, project, *values, acked, self.engine_id, floating, acked, self.lease_seconds),
        )
        row = cur.fetchone()
        if row is not None:
            cur.execute(f"NOTIFY {EVENTS_CHANNEL}")
            return FiredEvent.from_pending(fire, cursor=row[0], job_id=job_id, project=project)
        cur.execute(f"SELECT {EVENT_COLUMNS}, acked FROM {_EVENTS} WHERE fire_id = %s", (fire.fire_id,))
        found = cur.fetchone()
        event = None if found is None else event_or_none(found[:-1])
        if event is None:
            raise StoreError(f"the logged event of fire {fire.fire_id!r} is unreadable")
        if acked and not found[-1]:
            cur.execute(f"UPDATE {_EVENTS} SET acked = true WHERE cursor = %s", (event.cursor,))
        return event

    def _record(self, job_id: str, fire: PendingFire, *, acked: bool) -> Callable[[Any], FiredEvent]:
        def run(cur: Any) -> FiredEvent:
            cur.execute(
                "SELECT pending_fire, project, data FROM gadget_jobs WHERE id = %s FOR UPDATE", (job_id,)
            )
            row = cur.fetchone()
            if row is None:
                raise JobNotFoundError(
                    f"job_id {job_id!r} names no cron job; its fire {fire.fire_id!r} is not logged"
                )
            job = job_or_none(job_id, row[2])
            event = self._append(
                cur, job_id, row[1], fire, acked=acked, floating=job is not None and floats(job)
            )
            if row[0] is not None:
                pending = pending_or_none(row[0], job_id)
                if pending is None or pending.fire_id == event.fire_id:
                    cur.execute("UPDATE gadget_jobs SET pending_fire = NULL WHERE id = %s", (job_id,))
            return event

        return run

    # -- exit notices (engine.cron._notices): this engine's own ------------------------------------------

    async def add_notice(self, job_id: str, project: str | None, fire: PendingFire) -> None:
        """Persist a subprocess's exit notice (owned by this engine) before it is recorded."""

        def run(cur: Any) -> None:
            cur.execute(
                "INSERT INTO gadget_notices (fire_id, job_id, project, owner, fire) "
                "VALUES (%s, %s, %s, %s, %s)",
                (fire.fire_id, job_id, project, self.engine_id, json.dumps(fire.to_dict())),
            )

        await self._call(run, write=True)

    async def record_notice(self, fire_id: str, *, acked: bool) -> FiredEvent | None:
        """Append the notice's fire to the event log (not floating) and delete the notice, atomically."""

        def run(cur: Any) -> FiredEvent | None:
            cur.execute(
                "DELETE FROM gadget_notices WHERE fire_id = %s RETURNING job_id, project, fire", (fire_id,)
            )
            row = cur.fetchone()
            fire = None if row is None else pending_or_none(row[2], row[0])
            if row is None or fire is None:
                return None
            return self._append(cur, row[0], row[1], fire, acked=acked, floating=False)

        return await self._call(run, write=True)

    async def pending_notices(self) -> list[str]:
        """The fire ids of this engine's notices persisted and not recorded yet, oldest first."""

        def run(cur: Any) -> list[str]:
            cur.execute("SELECT fire_id FROM gadget_notices WHERE owner = %s ORDER BY seq", (self.engine_id,))
            return [str(row[0]) for row in cur.fetchall()]

        return await self._call(run, write=False)

    async def record_event(self, job_id: str, fire: PendingFire) -> FiredEvent:
        """Append ``fire`` unacknowledged (leased to this engine), clearing the job's pending fire."""
        return await self._call(self._record(job_id, fire, acked=False), write=True)

    async def deliver_fire(self, job_id: str, fire: PendingFire) -> FiredEvent:
        """Append ``fire`` acknowledged (deduplicated by ``fire_id``), clearing the pending fire."""
        return await self._call(self._record(job_id, fire, acked=True), write=True)

    async def ack_events(self, cursors: Iterable[int]) -> None:
        """Mark the events at ``cursors`` delivered."""
        rows = list(cursors)

        def run(cur: Any) -> None:
            cur.execute(f"UPDATE {_EVENTS} SET acked = true WHERE cursor = ANY(%s)", (rows,))

        await self._call(run, write=True)

    async def unacked_events(self) -> list[FiredEvent]:
        """The unacknowledged events this engine logged, and those of floating jobs whose lease ran out
        (taken over: leased to this engine from now), in cursor order."""

        def run(cur: Any) -> list[FiredEvent]:
            cur.execute(
                f"UPDATE {_EVENTS} SET engine_id = %s, leased_until = now() + make_interval(secs => %s) "
                "WHERE NOT acked AND engine_id IS DISTINCT FROM %s AND floats AND leased_until < now()",
                (self.engine_id, self.lease_seconds, self.engine_id),
            )
            cur.execute(
                f"SELECT {EVENT_COLUMNS} FROM {_EVENTS} WHERE NOT acked AND engine_id = %s ORDER BY cursor",
                (self.engine_id,),
            )
            return [e for e in (event_or_none(r) for r in cur.fetchall()) if e is not None]

        return await self._call(run, write=True)

    async def pending_fires(self) -> list[tuple[CronJob, PendingFire]]:
        """The committed, unlogged fires of floating jobs and of this engine's own, oldest job first."""

        def run(cur: Any) -> list[tuple[CronJob, PendingFire]]:
            cur.execute(
                "SELECT id, data, pending_fire FROM gadget_jobs WHERE pending_fire IS NOT NULL "
                "AND (floats OR owner = %s) ORDER BY seq",
                (self.engine_id,),
            )
            found = []
            for job_id, data, text in cur.fetchall():
                job = job_or_none(job_id, data)
                fire = pending_or_none(text, job_id)
                if job is not None and fire is not None:
                    found.append((job, fire))
            return found

        return await self._call(run, write=False)

    async def set_watch_state(self, job_id: str, state: StoredWatch | None) -> None:
        """Set (``None``: clear) the watch state of job ``job_id``. Raises: JobNotFoundError."""
        if await self.set_watch_states({job_id: state}):
            raise JobNotFoundError(f"job_id {job_id!r} names no cron job")

    async def set_watch_states(self, states: Mapping[str, StoredWatch | None]) -> frozenset[str]:
        """Set (``None``: clear) the watch state of each job in ``states``, in one transaction; return the
        ids that name no job (the others are set)."""
        rows = [
            (None if state is None else json.dumps(state.to_dict()), job_id)
            for job_id, state in states.items()
        ]

        def run(cur: Any) -> frozenset[str]:
            missing = []
            for text, job_id in rows:
                cur.execute("UPDATE gadget_jobs SET watch_state = %s WHERE id = %s", (text, job_id))
                if cur.rowcount == 0:
                    missing.append(job_id)
            return frozenset(missing)

        return await self._call(run, write=True)

    async def watch_states(self) -> dict[str, StoredWatch]:
        """The watch states of this engine's own jobs (another engine's commands are not ours to see)."""

        def run(cur: Any) -> dict[str, StoredWatch]:
            cur.execute(
                "SELECT id, watch_state FROM gadget_jobs WHERE watch_state IS NOT NULL AND owner = %s",
                (self.engine_id,),
            )
            states = {job_id: watch_state_or_none(text, job_id) for job_id, text in cur.fetchall()}
            return {k: v for k, v in states.items() if v is not None}

        return await self._call(run, write=False)

    async def events(self, since: int = 0) -> list[FiredEvent]:
        """The logged events with ``cursor > since``, oldest first (commit order: none is ever skipped)."""

        def run(cur: Any) -> list[FiredEvent]:
            cur.execute(f"SELECT {EVENT_COLUMNS} FROM {_EVENTS} WHERE cursor > %s ORDER BY cursor", (since,))
            return [e for e in (event_or_none(r) for r in cur.fetchall()) if e is not None]

        return await self._call(run, write=False)

    # -- claims, notifications, heartbeats -------------------------------------------------------------

    async def claim_due(
        self, now: datetime, *, skip: Collection[str] = (), acked: bool, limit: int = CLAIM_BATCH
    ) -> DueClaims:
        """Claim the due jobs this engine may run, at the database's ``now()`` (``now`` is not used):
        floating jobs and its own, locked with ``FOR UPDATE SKIP LOCKED``; see the module's text."""
        skipped = list(skip)

        def run(cur: Any) -> DueClaims:
            db_now: datetime = cur.execute("SELECT now()").fetchone()[0].astimezone(UTC)
            mine = "(floats OR owner = %s) AND NOT (id = ANY(%s))"
            cur.execute(
                f"SELECT id, data FROM gadget_jobs WHERE due_at <= now() AND {mine} "
                "ORDER BY due_at, seq LIMIT %s FOR UPDATE SKIP LOCKED",
                (self.engine_id, skipped, limit + 1),
            )
            rows = cur.fetchall()
            claims = []
            for job_id, data in rows[:limit]:
                job = job_or_none(job_id, data)
                taken = None if job is None else take_due(job, db_now)
                if job is None or taken is None:
                    continue
                after, fire = taken
                self._write(cur, after, job)
                event = None
                if fire is not None:
                    event = self._append(cur, job.id, job.project, fire, acked=acked, floating=floats(job))
                claims.append(Claim(after, event))
            cur.execute(
                f"SELECT min(due_at) FILTER (WHERE due_at > now()), bool_or(due_at <= now()) "
                f"FROM gadget_jobs WHERE due_at IS NOT NULL AND {mine}",
                (self.engine_id, skipped),
            )
            later, locked = cur.fetchone()
            full = len(rows) > limit
            if locked and not full:  # due, and claimed by another engine's open transaction: look again soon
                soon = db_now + timedelta(seconds=LOCKED_RECHECK_SECONDS)
                later = soon if later is None else min(later, soon)
            return DueClaims(claims, db_now, later, full=full)

        return await self._call(run, write=True)

    async def prepare_claims(self, until: datetime) -> None:
        """Nothing to make ahead: the fleet's claims are decided on the database's clock, among engines
        that lock the rows they take (:attr:`prepare_ahead_seconds` is 0, so the timer never asks)."""
        await trio.lowlevel.checkpoint()

    async def listen(
        self,
        on_jobs: Callable[[], None],
        on_events: Callable[[], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """``LISTEN`` for job changes and appended events of the whole fleet, until cancelled; after a
        lost connection, connect again with back-off (both handlers called once it is back)."""
        listener = Listener(self.url, {JOBS_CHANNEL: on_jobs, EVENTS_CHANNEL: on_events}, RetryPolicy())
        await listener.run(task_status=task_status)

    async def beat(self, member: FleetMember) -> None:
        """Write this engine's heartbeat, stamped with the database's ``now()``."""

        def run(cur: Any) -> None:
            cur.execute(
                "INSERT INTO gadget_engines (engine_id, host, pid, version, containment, live_runs, "
                "started_at, beat_at) VALUES (%s, %s, %s, %s, %s, %s, %s, now()) ON CONFLICT (engine_id) "
                "DO UPDATE SET host = excluded.host, pid = excluded.pid, version = excluded.version, "
                "containment = excluded.containment, live_runs = excluded.live_runs, "
                "started_at = excluded.started_at, beat_at = now()",
                (
                    member.engine_id,
                    member.host,
                    member.pid,
                    member.version,
                    member.containment,
                    member.live_runs,
                    member.started_at,
                ),
            )

        await self._call(run, write=True)

    async def fleet(self) -> list[FleetMember]:
        """Every engine's last heartbeat with its age on the database's clock, oldest engine first."""

        def run(cur: Any) -> list[FleetMember]:
            cur.execute(
                "SELECT engine_id, host, pid, version, containment, live_runs, started_at, beat_at, "
                "greatest(0, extract(epoch FROM now() - beat_at))::float8 FROM gadget_engines "
                "ORDER BY started_at, engine_id"
            )
            members = []
            for engine_id, host, pid, version, containment, runs, started, beat, age in cur.fetchall():
                members.append(
                    FleetMember(
                        engine_id=engine_id,
                        host=host,
                        pid=pid,
                        version=version,
                        containment=containment,
                        live_runs=runs,
                        started_at=started,
                        beat_at=beat,
                        age_seconds=age,
                        lost=age > self.owner_lost_seconds,
                    )
                )
            return members

        return await self._call(run, write=False)
