"""The decision core of the exit watchers: watcher slots and arm tokens, synchronous and I/O-free.

A *slot* is the right of one watcher task to run, persist and fire for one on-exit job. It carries an
*arm token*, fresh for every arm: a task may act only while ``owns(job_id, token)`` holds, so a task whose
job was cancelled or re-armed (the token changed) never persists and never fires.

The one race that needs more than a token check: a watcher whose command has exited is *committing* (its
"disable the job + pending fire" transaction is under way) when ``reconcile`` is told to re-arm the job
with a changed command. Then the commit decides, atomically with respect to reconcile:

- the commit succeeded: the old generation's exit is the job's one fire; the re-arm is dropped (the job
  is disabled in the store);
- the commit failed: nothing was persisted, the old exit is dropped and the re-arm happens.

So for one arm there is never more than one fire, and never zero once the remaining command has exited.
Disable or removal while committing leaves the decision to the commit too (a removed job's commit fails
with ``JobNotFoundError``).
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable

import attrs

from ._job import CronJob
from ._schedule import OnExit

__all__ = ["ArmTable", "Decisions", "Slot", "SlotState", "watchable"]


def watchable(job: CronJob) -> bool:
    """Whether ``job`` should have a watcher: enabled and with an :class:`OnExit` schedule."""
    return job.enabled and isinstance(job.schedule, OnExit)


def _target(job: CronJob) -> tuple[str, str | None]:
    assert isinstance(job.schedule, OnExit)
    return job.schedule.command, job.schedule.cwd


class SlotState(enum.Enum):
    """Where a watcher is: running its command, committing its exit, or holding a result to retry."""

    RUNNING = "running"
    COMMITTING = "committing"
    RETRYING = "retrying"


@attrs.define(eq=False)
class Slot:
    """One armed watcher.

    Attributes:
        job: the newest job record (a payload-only change updates it; the fire uses it).
        token: the arm token.
        state: see :class:`SlotState`.
        successor: a re-arm that waits for this slot's commit to decide.
    """

    job: CronJob
    token: int
    state: SlotState = SlotState.RUNNING
    successor: CronJob | None = None

    @property
    def target(self) -> tuple[str, str | None]:
        """The ``(command, cwd)`` this slot watches."""
        return _target(self.job)


@attrs.frozen
class Decisions:
    """What one reconcile decided.

    Attributes:
        arm: ``(job, token)`` pairs to start a watcher for.
        cancel: ``(job_id, token)`` of watchers to end (their commands are ended, nothing fires).
    """

    arm: tuple[tuple[CronJob, int], ...] = ()
    cancel: tuple[tuple[str, int], ...] = ()


@attrs.define
class ArmTable:
    """The watcher slots of one engine, keyed by job id."""

    _slots: dict[str, Slot] = attrs.field(factory=dict)
    _tokens: itertools.count[int] = attrs.field(factory=lambda: itertools.count(1))

    def __len__(self) -> int:
        return len(self._slots)

    def active_job_ids(self) -> list[str]:
        """Ids of the jobs with a slot, in arming order."""
        return list(self._slots)

    def slot(self, job_id: str) -> Slot | None:
        """The slot of ``job_id``, if any."""
        return self._slots.get(job_id)

    def owns(self, job_id: str, token: int) -> bool:
        """Whether ``token`` is still the arm of ``job_id``."""
        slot = self._slots.get(job_id)
        return slot is not None and slot.token == token

    def arm(self, job: CronJob) -> int:
        """Give ``job`` a new slot with a fresh token (replacing any slot it had) and return the token."""
        token = next(self._tokens)
        self._slots[job.id] = Slot(job=job, token=token)
        return token

    def reconcile(self, jobs: Iterable[CronJob]) -> Decisions:
        """Bring the slots to the complete desired set ``jobs``; say which watchers to start and end.

        Unchanged jobs keep their slot (same token, same command); a payload-only change updates the
        slot's job; a changed command or cwd re-arms; a job no longer watchable loses its slot.
        """
        desired = {job.id: job for job in jobs if watchable(job)}
        arm: list[tuple[CronJob, int]] = []
        cancel: list[tuple[str, int]] = []
        for job_id, slot in list(self._slots.items()):
            if job_id in desired:
                continue
            if slot.state is SlotState.COMMITTING:
                slot.successor = None  # the commit decides; nothing is re-armed after it
            else:
                cancel.append((job_id, slot.token))
                del self._slots[job_id]
        for job_id, job in desired.items():
            current = self._slots.get(job_id)
            if current is None:
                arm.append((job, self.arm(job)))
            elif _target(job) == current.target:
                current.job = job
                current.successor = None
            elif current.state is SlotState.COMMITTING:
                current.successor = job
            else:
                cancel.append((job_id, current.token))
                arm.append((job, self.arm(job)))
        return Decisions(arm=tuple(arm), cancel=tuple(cancel))

    def cancel(self, job_id: str) -> int | None:
        """Drop ``job_id``'s slot unless it is committing; return the token of the dropped slot."""
        slot = self._slots.get(job_id)
        if slot is None:
            return None
        if slot.state is SlotState.COMMITTING:
            slot.successor = None
            return None
        del self._slots[job_id]
        return slot.token

    def begin_commit(self, job_id: str, token: int) -> CronJob | None:
        """The watcher's command exited: mark the slot committing; return the job to fire with.

        ``None`` when the token no longer owns the slot: the watcher must not persist.
        """
        if not self.owns(job_id, token):
            return None
        slot = self._slots[job_id]
        slot.state = SlotState.COMMITTING
        return slot.job

    def end_commit(self, job_id: str, token: int, *, committed: bool) -> tuple[CronJob, int] | None:
        """The commit finished. On success the slot is released; on failure it waits to retry, or
        gives way to a successor, which is armed and returned as ``(job, token)``.
        """
        if not self.owns(job_id, token):
            return None
        slot = self._slots[job_id]
        if committed:
            del self._slots[job_id]
            return None
        if slot.successor is not None:
            successor = slot.successor
            return successor, self.arm(successor)
        slot.state = SlotState.RETRYING
        return None

    def release(self, job_id: str, token: int) -> None:
        """Drop the slot if ``token`` still owns it (the watcher is done)."""
        if self.owns(job_id, token):
            del self._slots[job_id]
