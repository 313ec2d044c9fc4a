"""The scheduler's decisions, as pure functions of a job and the wall time.

Which jobs are due, when to wake up next, what a job looks like once the run pipeline has claimed a due
time, and once the run has ended. The service applies these inside store transactions; the property
tests drive them directly with generated schedules and clock steps.

The rules:

- A job is due when it is enabled and ``last_run_at < next_run_at <= now``.
- Claiming a due time sets ``last_run_at = now`` and moves ``next_run_at`` strictly after ``now``, in the
  same transaction, before anything runs: a job never runs twice for one due time, and after downtime the
  slots missed meanwhile collapse into that one run (coalescing).
- A one-shot job (``At``) is disabled when claimed; once its run succeeded, ``delete_after_run`` removes it.
- A recurring job that failed waits at least a back-off (30 s, 1 min, 5 min, 15 min, then 60 min).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

import attrs

from ._job import CronJob, JobStatus
from ._schedule import At, OnExit, next_run_after

__all__ = [
    "BACKOFF_SECONDS",
    "claim",
    "claim_and_finish",
    "finish",
    "interrupted",
    "is_due",
    "next_wake",
    "schedule_next",
    "should_delete",
]

#: Minimum wait of a recurring job after its 1st, 2nd, ... consecutive failed run, in seconds.
BACKOFF_SECONDS = (30.0, 60.0, 300.0, 900.0, 3600.0)


def _waiting(job: CronJob) -> bool:
    return (
        job.enabled
        and job.next_run_at is not None
        and (job.last_run_at is None or job.next_run_at > job.last_run_at)
    )


def is_due(job: CronJob, now: datetime) -> bool:
    """Whether the timer should run ``job`` at wall time ``now``."""
    return _waiting(job) and job.next_run_at is not None and job.next_run_at <= now


def next_wake(jobs: Iterable[CronJob]) -> datetime | None:
    """The earliest time one of ``jobs`` becomes due (possibly already past), or ``None`` if none will."""
    times = [job.next_run_at for job in jobs if _waiting(job) and job.next_run_at is not None]
    return min(times, default=None)


def schedule_next(job: CronJob, now: datetime) -> datetime | None:
    """``job``'s next run time after ``now`` and after its last run, or ``None`` (disabled, one-shot done)."""
    if not job.enabled:
        return None
    return next_run_after(job.schedule, now, last_run_at=job.last_run_at, default_anchor=job.created_at)


def claim(job: CronJob, now: datetime) -> CronJob:
    """``job`` once the run pipeline has taken it at ``now`` (a due time, or ``run_now``).

    ``last_run_at`` becomes ``now`` and the status ``RUNNING``. A one-shot ``At`` is disabled. An
    on-exit job keeps its schedule state (only its watcher fires it on an exit).
    """
    return _taken(job, now, last_status=JobStatus.RUNNING)


def claim_and_finish(job: CronJob, now: datetime) -> CronJob:
    """``finish(claim(job, now), now, error=None)`` in one step, with one next-run computation.

    A ``SystemEvent``'s fire is over once it is logged, so its claim and its successful end are written
    together (the timer claims every job of a burst this way). Both forms take the next run from
    :func:`_taken`; ``tests/test_cron_schedule.py`` holds them equal.
    """
    return _taken(job, now, last_status=JobStatus.OK, last_error=None, consecutive_errors=0)


def _taken(job: CronJob, now: datetime, **status: Any) -> CronJob:
    # The schedule's part of a claim, said once: a one-shot ``At`` is disabled, an on-exit job keeps its
    # state, a recurring job's next run comes after ``now`` and its (moved) last run.
    last = now if job.last_run_at is None else max(now, job.last_run_at)
    enabled, after = job.enabled, job.next_run_at
    if isinstance(job.schedule, At):
        enabled, after = False, None
    elif not isinstance(job.schedule, OnExit):
        after = None
        if enabled:
            after = next_run_after(job.schedule, now, last_run_at=last, default_anchor=job.created_at)
    return attrs.evolve(job, enabled=enabled, next_run_at=after, last_run_at=last, updated_at=now, **status)


def finish(job: CronJob, now: datetime, *, error: str | None) -> CronJob:
    """``job`` once its run ended at ``now``, ``error`` saying what failed (``None``: it went well).

    A recurring job's next run is strictly after ``now`` (coalescing a long run), and after a failure at
    least the back-off away. Whether the job is then deleted is :func:`should_delete`'s call, made once the
    fire has been delivered.
    """
    if error is None:
        job = attrs.evolve(job, last_status=JobStatus.OK, last_error=None, consecutive_errors=0)
    else:
        job = attrs.evolve(
            job, last_status=JobStatus.ERROR, last_error=error, consecutive_errors=job.consecutive_errors + 1
        )
    job = attrs.evolve(job, updated_at=now)
    if isinstance(job.schedule, At | OnExit):
        return job
    after = next_run_after(job.schedule, now, last_run_at=job.last_run_at, default_anchor=job.created_at)
    if after is not None and error is not None:
        backoff = BACKOFF_SECONDS[min(job.consecutive_errors, len(BACKOFF_SECONDS)) - 1]
        after = max(after, now + timedelta(seconds=backoff))
    return attrs.evolve(job, next_run_at=after if job.enabled else None)


def should_delete(job: CronJob) -> bool:
    """Whether a finished job goes away: a one-shot ``At`` with ``delete_after_run`` whose run succeeded."""
    return job.delete_after_run and isinstance(job.schedule, At) and job.last_status is JobStatus.OK


def interrupted(job: CronJob, now: datetime) -> CronJob:
    """``job`` found ``RUNNING`` at start-up: the engine stopped mid-run. The due time stays consumed."""
    if job.last_status is not JobStatus.RUNNING:
        return job
    return attrs.evolve(
        job,
        last_status=JobStatus.INTERRUPTED,
        last_error="the engine stopped while the job was running",
        updated_at=now,
    )
