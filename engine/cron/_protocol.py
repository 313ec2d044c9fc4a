"""The ``JobStore`` protocol: what the cron service and the exit watchers need from a job store."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from datetime import datetime
from typing import Protocol

import trio

from ._claims import CLAIM_BATCH, DueClaims
from ._events import FiredEvent, PendingFire
from ._fleet import FleetMember
from ._job import CronJob
from ._watch_state import StoredWatch

__all__ = ["JobChange", "JobStore"]

#: A pure, synchronous edit of a job, applied inside a store transaction to the job as stored.
JobChange = Callable[[CronJob], CronJob]


class JobStore(Protocol):
    """Where jobs, pending fires, watch state and the event log live.

    Every method is a checkpoint; every write is atomic. Failures raise :class:`StoreError` (an
    ``OSError``); a job id that names no job raises :class:`JobNotFoundError`. An exception raised by a
    ``change`` callable propagates unchanged and the transaction is rolled back.

    Cancellation (every method): a transaction that has begun runs to its end; the cancellation is
    delivered after it.
    """

    def describe(self) -> str:
        """Where the store is, for logs and ``status`` (``sqlite:/path``; a URL without its password)."""
        ...

    def owns(self, job: CronJob) -> bool:
        """Whether this engine runs ``job``'s owned work (a ``Command``, an on-exit command, its watch
        state, a ``RUNNING`` status left by a crash): every job of a SQLite store; on a fleet store the
        jobs whose ``owner`` is this engine."""
        ...

    async def open(self) -> None:
        """Open the store (create or migrate the schema)."""

    async def aclose(self) -> None:
        """Close the store; further calls fail."""

    async def list_jobs(self) -> list[CronJob]:
        """Every readable job, oldest first."""
        ...

    async def get_job(self, job_id: str) -> CronJob:
        """The job ``job_id``."""
        ...

    async def insert_job(self, job: CronJob) -> None:
        """Add a new job (its id must be new)."""

    async def update_job(self, job_id: str, change: JobChange) -> CronJob:
        """Replace the job by ``change(job)`` in one transaction and return the new job."""
        ...

    async def delete_job(
        self, job_id: str, *, acked: bool = True
    ) -> tuple[CronJob | None, FiredEvent | None]:
        """Delete the job and, in the same transaction, append its pending fire (if any) to the event log
        with ``acked`` as given; return the job (``None`` if its row was unreadable) and that event."""
        ...

    async def commit_fire(self, job_id: str, change: JobChange, pending_fire: PendingFire) -> CronJob:
        """In one transaction, replace the job by ``change(job)`` and set its ``pending_fire``."""
        ...

    async def record_event(self, job_id: str, fire: PendingFire) -> FiredEvent:
        """In one transaction, append ``fire`` unacknowledged to the event log (unless its ``fire_id`` is
        there) and clear the job's ``pending_fire`` if it is this fire; return the logged event. Raises
        :class:`JobNotFoundError`, appending nothing, if the job is gone."""
        ...

    async def deliver_fire(self, job_id: str, fire: PendingFire) -> FiredEvent:
        """:meth:`record_event`, the event acknowledged at once (standalone: exactly once)."""
        ...

    async def ack_events(self, cursors: Iterable[int]) -> None:
        """Mark the events at ``cursors`` as delivered (``on_fire`` returned)."""

    async def unacked_events(self) -> list[FiredEvent]:
        """The events not acknowledged yet, in cursor order."""
        ...

    async def pending_fires(self) -> list[tuple[CronJob, PendingFire]]:
        """Every job with a committed, undelivered fire, and that fire."""
        ...

    async def set_watch_state(self, job_id: str, state: StoredWatch | None) -> None:
        """Set (or, with ``None``, clear) the job's watch state (or its arm before the spawn)."""

    async def set_watch_states(self, states: Mapping[str, StoredWatch | None]) -> frozenset[str]:
        """Set (or clear) the watch states of several jobs in one transaction (the watchers' group
        commit); return the ids that name no job (the others are set)."""
        ...

    async def watch_states(self) -> dict[str, StoredWatch]:
        """Every job's watch state (or arm before its spawn, :class:`ArmIntent`), by job id."""
        ...

    async def events(self, since: int = 0) -> list[FiredEvent]:
        """The events with a cursor greater than ``since``, in order. A reader never skips an event:
        one that commits later has a greater cursor."""
        ...

    async def claim_due(
        self, now: datetime, *, skip: Collection[str] = (), acked: bool, limit: int = CLAIM_BATCH
    ) -> DueClaims:
        """In one transaction, claim every due time this engine may run (``_claims``), oldest first, at
        most ``limit``: each job written as claimed and each ``SystemEvent`` fire appended to the log
        (``acked`` as given), deduplicated by its ``fire_id``. ``now`` is the engine's wall time; a fleet
        store decides on the database's clock instead. Jobs in ``skip`` (running here) are left."""
        ...

    @property
    def prepare_ahead_seconds(self) -> float:
        """How long before a due time the timer calls :meth:`prepare_claims` (0: the store makes its
        claims at the due time only)."""
        ...

    async def prepare_claims(self, until: datetime) -> None:
        """Make ahead what :meth:`claim_due` can of the claims of the jobs due by ``until`` (SQLite:
        ``_prepared``), writing nothing; a store may do nothing. A claim made ahead is used only for the
        job as it was then: a job changed meanwhile is claimed as if nothing had been made."""

    async def listen(
        self,
        on_jobs: Callable[[], None],
        on_events: Callable[[], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Until cancelled, call ``on_jobs()`` when another engine may have changed the jobs and
        ``on_events()`` when it may have appended events (a fleet store: ``LISTEN/NOTIFY``; SQLite, where
        one engine writes: never)."""

    async def beat(self, member: FleetMember) -> None:
        """Publish this engine's heartbeat (``member``'s ``age_seconds`` and ``lost`` are ignored)."""

    async def fleet(self) -> list[FleetMember]:
        """Every engine's last heartbeat, with its age on the store's clock, oldest engine first."""
        ...
