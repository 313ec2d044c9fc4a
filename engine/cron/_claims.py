"""Claiming due times: the decisions both job stores share, as pure functions, and what a claim returns.

The timer asks its store to claim every due time it may run (:meth:`JobStore.claim_due`). Both stores
take the same steps in one transaction; only how they find and lock the due jobs differs (SQLite: the
one writer; PostgreSQL: ``FOR UPDATE SKIP LOCKED`` among the engines of a fleet):

- a due job is claimed at the store's ``now`` (:func:`take_due`): ``last_run_at`` moves to ``now`` and
  ``next_run_at`` past it, so no due time is claimed twice;
- a ``SystemEvent`` job's fire is finished in the same transaction and its event appended to the log
  there too, with a ``fire_id`` fixed by the job and the due time (:func:`due_fire_id`): the event log
  holds one event per due time, whatever engine claims it and whatever engine dies;
- a ``Command`` job is only claimed; the service runs the command and commits its fire when it ended.

Which jobs an engine may run (:func:`floats`): a ``SystemEvent`` payload on a timed schedule floats, any
engine of a fleet may fire it; a ``Command`` payload and every on-exit job belong to their owner, the
engine that added them (``CronJob.owner``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from datetime import datetime

import attrs

from .._errors import EngineError
from ._events import FiredEvent, PendingFire, text_fire
from ._job import CronJob, SystemEvent
from ._plan import claim, claim_and_finish, is_due
from ._schedule import OnExit

__all__ = [
    "CLAIM_BATCH",
    "Claim",
    "DueClaims",
    "JobOwnedElsewhereError",
    "due_at",
    "due_fire_id",
    "floats",
    "take_due",
]

#: The most due times one claim transaction takes (the timer asks again at once for the rest).
CLAIM_BATCH = 200


class JobOwnedElsewhereError(EngineError, RuntimeError):
    """Raised by ``CronService.run_now`` for a job that only another engine of the fleet may run (a
    ``Command`` payload or an on-exit job it added)."""


@attrs.frozen
class Claim:
    """One due time claimed: the job as written by the claim, and the event logged with it, if any.

    Attributes:
        job: the job after the claim (``SystemEvent`` jobs: finished too).
        event: the fire's event, appended to the log in the claim's transaction (``SystemEvent``
            payloads), or ``None`` (a ``Command`` to run now).
    """

    job: CronJob
    event: FiredEvent | None


@attrs.frozen
class DueClaims:
    """What one :meth:`JobStore.claim_due` took, and when to look again.

    Attributes:
        claims: the due times claimed, oldest due first.
        now: the store's clock at the claim (PostgreSQL: the database's ``now()``), aware UTC.
        next_due: the earliest due time, after the claim, of a job this engine may run (``None``: none
            waits); it may already be past when the batch was full.
        full: whether the claim stopped at its batch size (more may be due now).
    """

    claims: Sequence[Claim]
    now: datetime
    next_due: datetime | None
    full: bool = False


def floats(job: CronJob) -> bool:
    """Whether any engine of a fleet may fire ``job``: a ``SystemEvent`` on a timed schedule."""
    return isinstance(job.payload, SystemEvent) and not isinstance(job.schedule, OnExit)


def due_at(job: CronJob) -> datetime | None:
    """When the timer should next claim ``job`` (``None``: never, as it stands), for the store's index."""
    if not job.enabled or job.next_run_at is None:
        return None
    if job.last_run_at is not None and job.next_run_at <= job.last_run_at:
        return None
    return job.next_run_at


def due_fire_id(job: CronJob) -> str:
    """The ``fire_id`` of ``job``'s current due time: the same for every engine that claims it."""
    assert job.next_run_at is not None
    key = f"{job.id}\0{job.next_run_at.isoformat()}".encode()
    return hashlib.sha256(key).hexdigest()[:24]


def take_due(job: CronJob, now: datetime) -> tuple[CronJob, PendingFire | None] | None:
    """``job`` once its due time is claimed at ``now``, and the fire to log with the claim.

    Returns:
        ``None`` if ``job`` is not due at ``now`` (another engine claimed it, or it changed); else the
        claimed job and, for a ``SystemEvent`` payload, its finished fire (``None`` for a ``Command``).
    """
    if not is_due(job, now):
        return None
    if not isinstance(job.payload, SystemEvent):
        return claim(job, now), None
    fire = text_fire(job.name, job.payload.text, fire_id=due_fire_id(job))
    return claim_and_finish(job, now), fire
