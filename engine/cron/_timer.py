"""The cron timer and run pipeline: what claims due times, runs ``Command`` payloads and hands fires over.

One :class:`CronTimer` per :class:`~engine.cron._service.CronService` (its ``timer``), in the service's
nursery. The timer sleeps on the Trio clock until the next due time (at most ``recheck_seconds``, or a job
change), claims every due job it may run in one store call (:meth:`JobStore.claim_due`), then starts a
task per claim: a ``Command`` is run through the supervisor and its fire committed once it ended; a
``SystemEvent``'s event, logged in the claim's transaction, is handed over. A job runs at most once at a
time here (``running``); ``remove`` cancels a run through its cancel scope (``run_scopes``).
"""

from __future__ import annotations

import functools
import logging
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, final

import attrs
import trio

from .._errors import JobNotFoundError
from ._claims import Claim, due_at
from ._command import run_command
from ._events import FiredEvent, PendingFire, text_fire
from ._job import Command, CronJob, SystemEvent
from ._plan import claim, claim_and_finish, finish, is_due, should_delete
from ._schedule import require_aware

if TYPE_CHECKING:
    from ._service import CronService

__all__ = ["CronTimer", "Run"]

logger = logging.getLogger("engine.cron")


class _StaleJobError(Exception):
    """The job changed between the look and the claim (another payload, no longer due)."""


@final
@attrs.define(eq=False)
class Run:
    """One run (or delivery) of a job under way here.

    Attributes:
        ended: set once it ended, whatever happened.
        removed: whether the job was removed while its command ran (nothing fired).
        fire_id: the id of its fire, once made (at the claim of a text job, at the end of a command):
            the event it appends to the event log carries it.
    """

    ended: trio.Event = attrs.field(factory=trio.Event)
    removed: bool = False
    fire_id: str | None = None


@final
@attrs.define(eq=False)
class CronTimer:
    """The timer and run pipeline of ``service`` (see the module's docstring).

    Attributes:
        service: the service it runs for (its store, supervisor, delivery, clock and settings).
        nursery: the service's nursery while it runs (``None`` before and after).
        running: the run or delivery under way of each job, by job id (set once it ended).
        run_scopes: the cancel scope of each of those runs (``remove`` cancels it).
    """

    service: CronService
    nursery: trio.Nursery | None = None
    running: dict[str, Run] = attrs.field(init=False, factory=dict)
    run_scopes: dict[str, trio.CancelScope] = attrs.field(init=False, factory=dict)
    _changed: trio.Event = attrs.field(init=False, factory=trio.Event)
    _passed_over: frozenset[str] = attrs.field(init=False, factory=frozenset)
    _delivering: dict[str, datetime | None] = attrs.field(init=False, factory=dict)
    _generation: int = attrs.field(init=False, default=0)
    _prepare_at: float | None = attrs.field(init=False, default=None)

    def _wall(self) -> datetime:
        return require_aware(self.service.now(), "now()")

    async def delete_if_done(self, job_id: str) -> None:
        """Delete ``job_id`` if its run made it done (a one-shot ``At`` with ``delete_after_run`` that
        succeeded), and tell the service; a job gone already, or a failing store (logged), is left."""
        try:
            job = await self.service.store.get_job(job_id)
            if should_delete(job):
                await self.service.store.delete_job(job_id)
                await self.service.notify_jobs_changed()
        except JobNotFoundError:
            pass
        except OSError as exc:
            logger.error("cron job %s: deleting it after its run failed (%s)", job_id, exc)

    def jobs_changed(self) -> None:
        """The jobs changed (here or on another engine of a fleet): wake the timer, and count it, so a
        delivery that began before reads its job again."""
        self._generation += 1
        self._changed.set()

    async def claim_and_start(self, job_id: str, now: datetime, *, forced: bool) -> Run | None:
        """Claim ``job_id``'s due time (or a forced run) and start its run; ``None`` if it was not due."""
        assert self.nursery is not None, "the cron service is not running"
        for _ in range(3):
            seen = await self.service.store.get_job(job_id)

            def change(job: CronJob, seen: CronJob = seen) -> CronJob:
                if job.payload != seen.payload:
                    raise _StaleJobError
                if not forced and not is_due(job, now):
                    raise _StaleJobError
                if isinstance(job.payload, SystemEvent):
                    return claim_and_finish(job, now)
                return claim(job, now)

            try:
                fire: PendingFire | None
                if isinstance(seen.payload, SystemEvent):
                    fire = text_fire(seen.name, seen.payload.text)
                    job = await self.service.store.commit_fire(job_id, change, fire)
                else:
                    fire = None
                    job = await self.service.store.update_job(job_id, change)
            except _StaleJobError:
                if not forced:
                    return None
                continue
            done = self.running[job_id] = Run(fire_id=None if fire is None else fire.fire_id)
            scope = self.run_scopes[job_id] = trio.CancelScope()
            self.nursery.start_soon(self._run_job, job, fire, done, scope, name=f"cron job {job_id}")
            return done
        raise JobNotFoundError(f"job_id {job_id!r} keeps changing; try run_now again")

    async def _run_job(
        self, job: CronJob, fire: PendingFire | None, done: Run, scope: trio.CancelScope
    ) -> None:
        try:
            if fire is None:
                assert isinstance(job.payload, Command)
                with scope:  # cancelled by remove(): the command is ended by escalation
                    fire = await self._run_command(job, job.payload)
                if fire is None:
                    logger.info("cron job %s was removed during its run; nothing fires", job.id)
                    done.removed = True
                    return
                done.fire_id = fire.fire_id
            await self.service.fire_pending(job.id, fire)
        except Exception:
            logger.exception("cron job %s: the run failed", job.id)
        finally:
            self._finished(job.id, done, scope)

    def _finished(self, job_id: str, done: Run, scope: trio.CancelScope, *, wake: bool = True) -> None:
        """A run (or delivery) of ``job_id`` ended: forget it, and wake the timer if ``wake``."""
        if self.run_scopes.get(job_id) is scope:
            del self.run_scopes[job_id]
        if self.running.get(job_id) is done:
            del self.running[job_id]
        done.ended.set()
        if wake:
            self._changed.set()

    async def _run_command(self, job: CronJob, payload: Command) -> PendingFire | None:
        """Run the command and commit its fire; ``None`` if the job was removed meanwhile (nothing fires)."""
        service = self.service
        fire, error = await run_command(
            service.supervisor, service.state_dir, job, payload, log_cap_bytes=service.log_cap_bytes
        )

        async def persist() -> None:  # retried on a store failure; the command never runs again for it
            change = functools.partial(finish, now=self._wall(), error=error)
            await self.service.store.commit_fire(job.id, change, fire)

        try:
            await self.service.retry.run(f"cron job {job.id}: persisting its run", persist, logger=logger)
        except JobNotFoundError:  # removed while it ran: a removed job never fires
            return None
        return fire

    async def run(self) -> None:
        """Look, claim and start what is due, then sleep until the next due time or a change; forever.

        Cancellation: the loop stops; runs under way are the nursery's (the service ends them).
        """
        while True:
            wake = await self.service.retry.run(
                "cron timer: reading the job store", self._start_due, logger=logger, sleep=self._wait_changed
            )
            changed = self._changed  # made by the look that just succeeded
            if wake is None:
                await changed.wait()
                continue
            if wake <= trio.current_time():
                continue  # more is due now: claim it before the fires just started take their turns
            with trio.move_on_at(wake):
                await self._wait(changed)

    async def _wait(self, changed: trio.Event) -> None:
        """Wait for ``changed``; meanwhile, at the time the look set (``_prepare_at``: half the store's
        ``prepare_ahead_seconds`` before the next due time, or at once if it is nearer), have the store
        make ahead the claims of the jobs due soon (``_prepared``). This reads no row: the store uses
        the jobs of the look, and a claim made for a job that changed since is never used. A failure
        only means the claims are made at the due time: it is logged, not retried.
        """
        if self._prepare_at is not None:
            with trio.move_on_at(self._prepare_at):
                await changed.wait()
            if changed.is_set():
                return
            until = self._wall() + timedelta(seconds=self.service.store.prepare_ahead_seconds)
            try:
                await self.service.store.prepare_claims(until)
            except OSError as exc:
                logger.warning("cron timer: making the claims of the jobs due soon failed (%s)", exc)
        await changed.wait()

    async def _start_due(self) -> float | None:
        """One look of the timer: claim every due job and start its run or deliver its event; return when
        to look again, on the Trio clock (``None``: at a change). The wait is counted on the store's
        clock, from when the look began: a claim that took a while does not delay the next due time.
        It also sets when the wait makes the claims of that next due time ahead (``_wait``).

        Raises:
            OSError: the store failed (the timer waits, then looks again; a change wakes it early).
        """
        assert self.nursery is not None
        self._changed = trio.Event()
        self._prepare_at = None
        skip = frozenset(self.running)
        delivering = {job_id: self._delivering[job_id] for job_id in skip if job_id in self._delivering}
        # Until the claim is back, the end of any of them wakes the timer, but a delivery that keeps no
        # due time (a spent one-shot): its end changes nothing the timer waits for.
        self._passed_over = frozenset(j for j in skip if j not in delivering or delivering[j] is not None)
        generation = self._generation  # taken before the claim: a change notified later is read again
        began = trio.current_time()
        try:
            acked = self.service.delivery.on_fire is None
            due = await self.service.store.claim_due(self._wall(), skip=skip, acked=acked)
        finally:
            self.service.delivery.defer_acks(False)
        self.service.delivery.defer_acks(due.full)  # more is due now: the next claim goes before the acks
        next_due = self._left_out(skip, delivering, due.now, due.next_due)
        for claimed in due.claims:
            self._start_claimed(claimed, generation)
        if due.full:
            return began  # look again at once
        if next_due is None:
            return None
        wait = max(0.0, (next_due - due.now).total_seconds())
        ahead = self.service.store.prepare_ahead_seconds
        if ahead > 0:  # with fires just started, not at once: they go first (the store thread takes the GIL)
            self._prepare_at = began + max(wait / 2 if due.claims else 0.0, wait - ahead / 2)
        return began + min(self.service.recheck_seconds, wait)

    def _left_out(
        self,
        skip: frozenset[str],
        delivering: dict[str, datetime | None],
        now: datetime,
        next_due: datetime | None,
    ) -> datetime | None:
        """The look's next due time, counting the jobs it left out (``skip``: running here).

        A ``SystemEvent`` being delivered keeps the due time its claim gave it (``delivering``, as the
        look began), so that time is counted here and the end of its delivery need not wake the timer.
        The end of any other left-out job does (a ``Command`` commits its next due time when it ends),
        as does that of a delivery already due again.
        """
        waking = set()
        for job_id in skip:
            if job_id not in delivering:
                waking.add(job_id)
                continue
            at = delivering[job_id]
            if at is not None and at <= now:
                waking.add(job_id)
            elif at is not None:
                next_due = at if next_due is None else min(next_due, at)
        self._passed_over = frozenset(waking)
        return next_due

    def _start_claimed(self, claimed: Claim, generation: int) -> None:
        """Run a claimed ``Command`` (in the nursery), or deliver a claimed ``SystemEvent``'s event
        (``generation``: the count of notified job changes when the claim began)."""
        assert self.nursery is not None
        job = claimed.job
        done = self.running[job.id] = Run()
        scope = self.run_scopes[job.id] = trio.CancelScope()
        if claimed.event is None:
            self.nursery.start_soon(self._run_job, job, None, done, scope, name=f"cron job {job.id}")
        else:
            self.service.delivery.hold(claimed.event)  # from the claim on, released by the delivery's task
            self._delivering[job.id] = due_at(job)
            self.nursery.start_soon(self._deliver_claimed, job, claimed.event, done, scope, generation)

    async def _deliver_claimed(
        self, job: CronJob, event: FiredEvent, done: Run, scope: trio.CancelScope, generation: int
    ) -> None:
        """Hand a claimed ``SystemEvent``'s event over, then delete the job if it is done.

        The claim finished the job in its transaction, so ``job`` is the job as stored unless a change
        was made since (``generation`` moved): only then is it read again to decide on its deletion.
        Its end wakes the timer only if a look left the job out and could not count its due time
        (``_left_out``). The event was held since the claim (``_start_claimed``).

        Once ``on_fire`` returned, the task does not wait for an acknowledgement another hand-over is
        writing (``Delivery.hand_over_held``): the delivery ends when that one is committed
        (``_delivered``), so a burst leaves no task per fire waiting.
        """
        delivery = self.service.delivery
        later = False
        try:
            ended = functools.partial(self._delivered, job, event, done, scope, generation)
            later = await delivery.hand_over_held(event, ended) is None
            if later:
                return
            delivery.release(event)
            if should_delete(job) or generation != self._generation:
                await self.delete_if_done(job.id)
        finally:
            if not later:  # (cancelled: released here)
                delivery.release(event)
                self._end_delivery(job.id, done, scope)

    def _delivered(
        self,
        job: CronJob,
        event: FiredEvent,
        done: Run,
        scope: trio.CancelScope,
        generation: int,
        acked: bool,
    ) -> None:
        """The acknowledgement a claimed event joined ended (``acked``: committed): end its delivery,
        deleting the job first (in a task) if it is done."""
        self.service.delivery.release(event)
        if acked and self.nursery is not None and (should_delete(job) or generation != self._generation):
            self.nursery.start_soon(self._delete_then_end, job.id, done, scope)
            return
        self._end_delivery(job.id, done, scope)

    async def _delete_then_end(self, job_id: str, done: Run, scope: trio.CancelScope) -> None:
        try:
            await self.delete_if_done(job_id)
        finally:
            self._end_delivery(job_id, done, scope)

    def _end_delivery(self, job_id: str, done: Run, scope: trio.CancelScope) -> None:
        self._delivering.pop(job_id, None)
        self._finished(job_id, done, scope, wake=job_id in self._passed_over)

    async def _wait_changed(self, seconds: float) -> None:
        """The timer's back-off after a store failure: ``seconds``, or until a job changes."""
        with trio.move_on_after(seconds):
            await self._changed.wait()
