"""Claims made ahead: the claim of a due time built before it is due, so that at the due time only the
store's writes are left to do.

A claim (:func:`~engine.cron._claims.take_due`) is a pure function of the job and of the claim time
``now``. Most of its cost does not depend on ``now``: the claimed job, its row text, the fire of a
``SystemEvent`` and that fire's id. Shortly before a burst is due, the SQLite store makes each of them
once (:func:`prepare_claim`) and keeps the result; at the claim it only puts ``now`` in
(:func:`claim_prepared`), then writes.

When a prepared claim may stand for a fresh one:

- it was made from the very job the claim looks at (the store checks the parsed job's identity: any
  change of the row gives another object, so an edit or a removal between the preparation and the due
  time never fires a stale preparation);
- the claim time is at or after the due time (the job is due) and before the next run the preparation
  computed: in between, the claim's next run is that same one (a schedule's next run after ``t`` is the
  first of its run times after ``t``; ``tests/test_cron_prepared.py`` holds this for every schedule
  kind). Outside it, :func:`claim_prepared` says ``None`` and the store claims afresh.

Nothing is written ahead: persist-before-fire and the exactly-once rules are the claim's, unchanged.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from datetime import datetime
from typing import final

import attrs

from ._claims import due_at, take_due
from ._events import PENDING_FIRE_FIELDS, PendingFire
from ._job import CronJob

__all__ = ["ClaimsAhead", "PreparedClaim", "TakenClaim", "claim_prepared", "fire_row", "prepare_claim"]

#: Stands for the claim time in a prepared row text (a value no job's text holds).
_MARK = f"claim-time-{uuid.uuid4().hex}"
_QUOTED_MARK = json.dumps(_MARK)
#: A job's fields in ``__init__``'s order, and where the claim time goes among them.
_JOB_FIELDS = tuple(field.name for field in attrs.fields(CronJob))
_LAST_RUN_AT = _JOB_FIELDS.index("last_run_at")
_UPDATED_AT = _JOB_FIELDS.index("updated_at")


@attrs.frozen
class PreparedClaim:
    """The claim of ``before``'s due time, made ahead (see the module's docstring).

    Attributes:
        before: the job it was made from (the store's parsed object: identity is the check).
        due: the due time it claims.
        job: the job as claimed at ``due``.
        job_args: its fields, in order (a claim at another time makes it again with two changed).
        text_parts: the claimed job's row text, cut where the claim time goes (``last_run_at`` and
            ``updated_at``).
        fire: the ``SystemEvent`` fire logged with the claim (``None``: a ``Command`` to run).
        fire_row: ``job_id, project`` and the fire's fields, the event's columns but ``acked``
            (``None`` without a fire).
    """

    before: CronJob
    due: datetime
    job: CronJob
    job_args: tuple[object, ...]
    text_parts: tuple[str, str, str]
    fire: PendingFire | None
    fire_row: tuple[object, ...] | None

    def valid_at(self, now: datetime) -> bool:
        """Whether a claim at ``now`` gives the prepared claim (``now`` in ``[due, next run)``)."""
        later = self.job.next_run_at
        return self.due <= now and (later is None or now < later)


def prepare_claim(job: CronJob) -> PreparedClaim | None:
    """The claim of ``job``'s next due time, made now for later; ``None`` if it waits for none."""
    due = due_at(job)
    taken = None if due is None else take_due(job, due)
    if due is None or taken is None:
        return None
    after, fire = taken
    marked = after.to_dict()
    marked["last_run_at"] = marked["updated_at"] = _MARK
    head, *rest = json.dumps(marked).split(_QUOTED_MARK)
    if len(rest) != 2:  # cannot happen (the mark is unique); claimed afresh then
        return None
    row = None if fire is None else fire_row(job, fire)
    args = tuple(getattr(after, name) for name in _JOB_FIELDS)
    return PreparedClaim(job, due, after, args, (head, rest[0], rest[1]), fire, row)


def fire_row(job: CronJob, fire: PendingFire) -> tuple[object, ...]:
    """The event columns of ``job``'s claimed ``fire`` but ``acked``: ``job_id, project``, its fields."""
    return (job.id, job.project, *(getattr(fire, name) for name in PENDING_FIRE_FIELDS))


def claim_prepared(
    prepared: PreparedClaim, now: datetime, *, stamp: str | None = None
) -> tuple[CronJob, str] | None:
    """The claimed job and its row text at ``now``, from ``prepared``: what ``take_due(prepared.before,
    now)`` gives and the store would write; ``None`` when ``now`` is outside :meth:`~PreparedClaim.valid_at`.

    Args:
        prepared: the claim made ahead.
        now: the claim time (aware).
        stamp: ``now`` as the row text holds it (``json.dumps(now.isoformat())``), if known already.
    """
    if not prepared.valid_at(now):
        return None
    args = list(prepared.job_args)
    args[_LAST_RUN_AT] = args[_UPDATED_AT] = now
    text = (json.dumps(now.isoformat()) if stamp is None else stamp).join(prepared.text_parts)
    return CronJob(*args), text  # type: ignore[arg-type]  # the fields of a job, in order


#: A claim as the store writes it: the job read, the job claimed, its row text, its fire (``None``: a
#: ``Command``) and the fire's event columns but ``acked`` (``job_id, project``, the fire's fields).
TakenClaim = tuple[CronJob, CronJob, str, PendingFire | None, tuple[object, ...] | None]


@final
@attrs.define(eq=False)
class ClaimsAhead:
    """The claims made ahead, by job id: what the SQLite store keeps between :meth:`prepare` (shortly
    before a burst) and :meth:`take` (at its claim). Used from one thread at a time (the store's).

    Attributes:
        limit: the most claims kept (the earliest due); a claim beyond them is made at the due time.
    """

    limit: int
    _ready: dict[str, PreparedClaim] = attrs.field(init=False, factory=dict)
    _stamp: tuple[datetime, str] | None = attrs.field(init=False, default=None)

    def __len__(self) -> int:
        return len(self._ready)

    def prepare(self, jobs: Iterable[CronJob], until: datetime) -> None:
        """Make the claims of those of ``jobs`` due by ``until``, earliest due first, at most
        :attr:`limit`; a claim made before for the same job object is kept, the others are forgotten."""
        soon = sorted(
            (
                (at, job.created_at, job.id, job)
                for job in jobs
                if (at := due_at(job)) is not None and at <= until
            ),
            key=lambda entry: entry[:3],
        )
        kept, self._ready = self._ready, {}
        for _at, _created, job_id, job in soon[: self.limit]:
            ready = kept.get(job_id)
            if ready is None or ready.before is not job:
                ready = prepare_claim(job)
            if ready is not None:
                self._ready[job_id] = ready

    def take(self, job: CronJob, now: datetime) -> TakenClaim | None:
        """The claim of ``job`` at ``now`` if one made ahead stands for it (made from this very object,
        ``now`` within :meth:`PreparedClaim.valid_at`), else ``None`` (the caller claims afresh). The
        claim made ahead is forgotten either way."""
        ready = self._ready.pop(job.id, None)
        if ready is None or ready.before is not job:
            return None
        if self._stamp is None or self._stamp[0] is not now:  # one claim: one time, written once
            self._stamp = (now, json.dumps(now.isoformat()))
        made = claim_prepared(ready, now, stamp=self._stamp[1])
        if made is None:
            return None
        return job, made[0], made[1], ready.fire, ready.fire_row
