"""The cron service: the job API, delivery and the service's life; its timer and run pipeline are
:class:`~engine.cron._timer.CronTimer` (``CronService.timer``).

One :class:`CronService` per engine (``engine.cron``). Its tasks live in a nursery of its own, opened by
:func:`open_cron_service` inside the engine's, and all stop when the engine closes.

Every fire takes the same path. A due time is *claimed* in one store transaction before anything runs
(``last_run_at`` moves to now, ``next_run_at`` past now): a claimed due time never runs again, a crash
included. The timer claims every due job it may run at once (:meth:`JobStore.claim_due`, ``_claims``);
a ``SystemEvent`` job's event is appended to the log in that same transaction, with a ``fire_id`` fixed
by the due time, so any engine of a fleet may fire it and exactly one event exists per due time. A
``Command`` job commits its fire once the command has ended, and ``run_now`` commits a fire on the job
first; a committed fire is then recorded in the event log. The service's :class:`Delivery` hands the
events over (``_delivery``; :meth:`CronService.fire_pending`).

Many jobs due together (a burst) cost a claim transaction per batch (SQLite: ``SQLITE_CLAIM_BATCH``,
1000; a fleet's PostgreSQL store: ``CLAIM_BATCH``, 200), each batch's fires handed over as soon as it is
committed, and their acknowledgements written together once the burst is claimed
(``Delivery.defer_acks``); the end of a claimed fire's delivery reads nothing from the store unless the
job changed meanwhile, and does not wake the timer (``_left_out``). A SQLite store makes a burst's
claims ahead, about a second before it is due (``_prepared``: the claimed jobs, their row texts, fires
and fire ids), so that at the due time its transaction only writes; and a claimed fire's task ends once
``on_fire`` returned, its acknowledgement written by another (``Delivery.hand_over_held``).

On a fleet store the store decides (``JobStore.owns``) which jobs are this engine's own: only those are
run here when their payload is a ``Command``, armed by the exit watchers, or reset at start-up.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import logging
import secrets
import shlex
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any, final

import attrs
import trio

from .._errors import InvalidArgumentError, InvalidScheduleError, JobNotFoundError
from .._input import check_flag, check_int, check_optional_text, check_text
from .._keyed_locks import KeyedLocks
from .._retry import RetryPolicy
from .._supervisor import Supervisor
from ._claims import JobOwnedElsewhereError, floats
from ._command import check_command_can_start
from ._delivery import Delivery, FireHandler, FireObserver
from ._events import FiredEvent, PendingFire
from ._job import CronJob, JobStatus, Payload, SystemEvent, validate_payload
from ._log_files import remove_job_logs
from ._notices import NoticeStore
from ._plan import interrupted, schedule_next
from ._protocol import JobStore
from ._schedule import (
    At,
    Cron,
    OnExit,
    Schedule,
    check_on_exit_cwd,
    next_run_after,
    require_aware,
    validate_schedule,
)
from ._store import SqliteJobStore
from ._timer import CronTimer

__all__ = ["CronService", "open_cron_service"]

logger = logging.getLogger("engine.cron")

#: ``on_jobs_changed`` handlers: awaited with the complete job list after each committed change.
JobsChangedHandler = Callable[[list[CronJob]], Awaitable[None]]

_UPDATABLE = ("name", "enabled", "schedule", "payload", "delete_after_run")


def utc_now() -> datetime:
    """The system's wall time, aware UTC (the default ``now`` of the service)."""
    return datetime.now(UTC)


def _default_name(payload: Payload) -> str:
    label = payload.text if isinstance(payload, SystemEvent) else shlex.join(payload.argv)
    return label if len(label) <= 60 else label[:57] + "..."


def _require_future(schedule: Schedule, now: datetime) -> None:
    if isinstance(schedule, At) and require_aware(schedule.at, "at") <= now:
        raise InvalidScheduleError(
            f"at {schedule.at.isoformat()} is in the past (now is {now.isoformat()}); give a future time"
        )


@final
@attrs.define(eq=False)
class CronService:
    """Scheduled jobs of one engine: add, change, remove, run them, and read the event log.

    Make it with :func:`open_cron_service` (``open_engine`` does), which runs :meth:`run`.

    Attributes:
        store: the :class:`JobStore`.
        supervisor: runs ``Command`` payloads.
        state_dir: the engine's state directory (``Command`` logs go to ``cron-logs/`` in it).
        now: returns the wall time, aware (tests steer it; the timer itself sleeps on the Trio clock).
        delivery: records fires in the event log and hands them to ``on_fire`` (embedded hosts).
        on_jobs_changed: awaited with the complete job list after every committed add, update, enable,
            disable or removal (and a job deleted after its run), and once at start-up. The exit
            watchers hook ``reconcile`` here. Calls never overlap and each sees the store as it is then.
            An exception from it propagates to the caller of the change, which stays committed.
        recheck_seconds: the longest the timer sleeps before it looks at the wall clock again.
        retry: the waits between attempts of a store write that must not be lost (a run's result) and
            between the timer's looks at a failing store.
        engine_id: this engine's id, kept as the ``owner`` of every job it adds.
        log_cap_bytes: the size each log of a running ``Command`` keeps on disk, in bytes.
    """

    store: JobStore
    supervisor: Supervisor
    state_dir: str
    now: Callable[[], datetime] = utc_now
    delivery: Delivery = attrs.field(
        default=attrs.Factory(lambda self: Delivery(self.store), takes_self=True)
    )
    on_jobs_changed: JobsChangedHandler | None = None
    recheck_seconds: float = 60.0
    retry: RetryPolicy = attrs.field(factory=RetryPolicy)
    log_cap_bytes: int = 50 * 2**20
    engine_id: str | None = None
    _nursery: trio.Nursery | None = attrs.field(init=False, default=None)
    _appended: trio.Event = attrs.field(init=False, factory=trio.Event)
    _reconcile_pending: bool = attrs.field(init=False, default=False)
    _notify_lock: trio.Lock = attrs.field(init=False, factory=trio.Lock)
    timer: CronTimer = attrs.field(init=False, default=attrs.Factory(CronTimer, takes_self=True))
    _timer_scope: trio.CancelScope = attrs.field(init=False, factory=trio.CancelScope)
    _run_now_locks: KeyedLocks = attrs.field(init=False, factory=KeyedLocks)

    def __repr__(self) -> str:
        state = "running" if self._nursery is not None else "not started"
        return f"<CronService {self.state_dir!r}: {state}, {len(self.timer.running)} job(s) running>"

    def _wall(self) -> datetime:
        return require_aware(self.now(), "now()")

    # -- the job API --------------------------------------------------------------------------------

    async def add(
        self,
        schedule: Schedule,
        payload: Payload,
        *,
        name: str | None = None,
        enabled: bool = True,
        delete_after_run: bool = False,
        project: str | None = None,
    ) -> CronJob:
        """Add a job and return it.

        Cancellation: if cancelled before the write starts, nothing is added; a write under way
        completes (the job exists) and the cancellation is raised after it.

        Args:
            schedule: when it runs (:class:`At` must be in the future).
            payload: what it does.
            name: a label (``None``: made from the payload).
            enabled: whether it is armed now.
            delete_after_run: remove a one-shot job once it ran successfully.
            project: the id of the project the job belongs to (``Project.id``), or ``None``; kept as
                ``CronJob.project`` and on its events (the MCP cron tools of a project see only its jobs).

        Raises:
            InvalidScheduleError: the schedule or payload is invalid (the field named), e.g. an ``OnExit``
                ``cwd`` that is relative or no existing directory; nothing is written.
            InvalidArgumentError: ``name``, ``enabled``, ``delete_after_run`` or ``project`` is invalid;
                nothing is written.
            StoreError: the write failed; nothing is written.
        """
        validate_schedule(schedule)
        check_on_exit_cwd(schedule)
        validate_payload(payload)
        check_command_can_start(payload)
        if name is not None:
            check_text(name, "name")
        check_flag(enabled, "enabled")
        check_flag(delete_after_run, "delete_after_run")
        check_optional_text(project, "project")
        now = self._wall()
        _require_future(schedule, now)
        next_run_at = next_run_after(schedule, now, default_anchor=now) if enabled else None
        if next_run_at is None and enabled and isinstance(schedule, Cron):
            raise InvalidScheduleError(f"expr {schedule.expr!r} matches no time in the next 50 years")
        job = CronJob(
            id=secrets.token_hex(6),
            name=name if name is not None else _default_name(payload),
            enabled=enabled,
            schedule=schedule,
            payload=payload,
            delete_after_run=delete_after_run,
            created_at=now,
            updated_at=now,
            next_run_at=next_run_at,
            project=project,
            owner=self.engine_id,
        )
        await self.store.insert_job(job)
        await self.notify_jobs_changed()
        return job

    async def update(self, job_id: str, **changes: Any) -> CronJob:
        """Change fields of a job (``name``, ``enabled``, ``schedule``, ``payload``, ``delete_after_run``).

        A new schedule, or enabling a disabled job, computes the next run afresh; disabling clears it.
        A new ``OnExit`` schedule's ``cwd`` must be an existing directory (as in :meth:`add`); enabling
        does not look at it again.

        Disabling does not stop a ``Command`` run under way: it runs to its end and fires (as a disabled
        job's ``run_now`` would); :meth:`remove` stops it.

        Cancellation: as :meth:`add`.

        Raises:
            JobNotFoundError: no job has this id.
            InvalidScheduleError: an invalid schedule or payload (the field named); nothing is written.
            InvalidArgumentError: ``job_id`` is not text, an unknown field, or an invalid name or flag;
                nothing is written.
            StoreError: the write failed; nothing is written.
        """
        check_text(job_id, "job_id")
        for key, value in changes.items():
            if key not in _UPDATABLE:
                raise InvalidArgumentError(
                    f"update got the unknown field {key!r}; fields: {', '.join(_UPDATABLE)}"
                )
            if key == "schedule":
                validate_schedule(value)
                check_on_exit_cwd(value)
            elif key == "payload":
                validate_payload(value)
                check_command_can_start(value)
            elif key == "name":
                check_text(value, "name")
            else:
                check_flag(value, key)
        now = self._wall()

        def change(job: CronJob) -> CronJob:
            new = attrs.evolve(job, updated_at=now, **changes)
            if not new.enabled:
                return attrs.evolve(new, next_run_at=None)
            if "schedule" in changes or not job.enabled:
                _require_future(new.schedule, now)
                new = attrs.evolve(new, next_run_at=schedule_next(new, now))
            return new

        job = await self.store.update_job(job_id, change)
        await self.notify_jobs_changed()
        return job

    async def enable(self, job_id: str) -> CronJob:
        """Arm a job (``update(job_id, enabled=True)``). Cancellation, errors: as :meth:`update`."""
        return await self.update(job_id, enabled=True)

    async def disable(self, job_id: str) -> CronJob:
        """Disarm a job (``update(job_id, enabled=False)``). Cancellation, errors: as :meth:`update`."""
        return await self.update(job_id, enabled=False)

    async def remove(self, job_id: str) -> None:
        """Delete a job and its ``Command`` logs, ending a ``Command`` run of it under way.

        The run's command is ended by escalation through the supervisor (scope ``cron:<job id>``: SIGINT,
        the grace period, SIGKILL) and nothing fires for it: once the job is deleted, no fire of it is
        appended to the event log. A fire it had committed before (an on-exit job's exit, say) is logged in
        the deleting transaction and delivered.

        Cancellation: if cancelled before the write starts, nothing is deleted. Once deleted, a run under
        way is still ended (in the service's nursery), only the waiting for it stops.

        Raises:
            JobNotFoundError: no job has this id.
            InvalidArgumentError: ``job_id`` is not text (blank, NUL, a lone surrogate).
            StoreError: the write failed; nothing is deleted.
        """
        check_text(job_id, "job_id")
        await trio.lowlevel.checkpoint_if_cancelled()
        with trio.CancelScope(shield=True):  # once the delete ran, the run must be told below
            _job, event = await self.store.delete_job(job_id, acked=self.delivery.on_fire is None)
        # No checkpoint from the delete to here: no redelivery pass can take the event meanwhile.
        scope = self.timer.run_scopes.get(job_id)
        if scope is not None:
            scope.cancel()
        with self.delivery.holding(event):
            busy = self.timer.running.get(job_id)
            if scope is not None and busy is not None:
                await busy.ended.wait()  # the command is ended by escalation, shielded, in the run's task
            await trio.to_thread.run_sync(remove_job_logs, self.state_dir, job_id)  # an on-exit job's too
            await self.notify_jobs_changed()
            if event is not None:
                await self.delivery.hand_over(event)

    async def get(self, job_id: str) -> CronJob:
        """The job ``job_id``.

        Cancellation: safe; nothing changes.

        Raises:
            JobNotFoundError: no job has this id.
            InvalidArgumentError: ``job_id`` is not text (blank, NUL, a lone surrogate).
        """
        check_text(job_id, "job_id")
        return await self.store.get_job(job_id)

    async def list(self, *, include_disabled: bool = True) -> builtins.list[CronJob]:
        """Every job, oldest first (only the enabled ones with ``include_disabled=False``).

        Cancellation: safe; nothing changes.
        """
        jobs = await self.store.list_jobs()
        return jobs if include_disabled else [job for job in jobs if job.enabled]

    async def events(self, since: int = 0) -> builtins.list[FiredEvent]:
        """The logged events after cursor ``since``, oldest first.

        Cancellation: safe; nothing changes.

        Raises:
            InvalidArgumentError: ``since`` is not an event cursor (an integer >= 0).
        """
        check_int(since, "since")
        return await self.store.events(since)

    async def wait_events(self, since: int, seconds: float) -> builtins.list[FiredEvent]:
        """The logged events after cursor ``since``, waiting up to ``seconds`` for the first one.

        Woken by every event this engine logs and, on a fleet store, by ``LISTEN/NOTIFY`` when another
        engine logs one: a follower needs no polling loop.

        Cancellation: safe; nothing changes.

        Returns:
            The events after ``since`` (empty if none came within ``seconds``).
        """
        with trio.move_on_after(seconds):
            while True:
                appended = self._appended
                events = await self.store.events(since)
                if events:
                    return events
                await appended.wait()
        return []

    def _events_appended(self) -> None:
        self._appended.set()
        self._appended = trio.Event()

    async def run_now(self, job_id: str) -> str | None:
        """Run a job now, whatever its schedule or enabled flag, and wait until its fire is delivered.

        Returns:
            The fire id of this run's event (``FiredEvent.fire_id``): with two calls at once, each tells
            its own run's event from the other's. ``None`` only for a run that fired nothing.

        A run of the same job under way is waited for first. An ``At`` job counts as run (disabled). An
        ``OnExit`` job is refused: it fires once, when its command exits, and a run now would fire it
        twice (now, and at that exit).

        Cancellation: if cancelled before the claim is written, nothing runs. Once claimed, the run goes
        on in the service's nursery; only the waiting stops.

        Raises:
            JobNotFoundError: no job has this id, or it was removed while its command ran (the command
                was ended and nothing fired).
            InvalidArgumentError: ``job_id`` is not text (blank, NUL, a lone surrogate), or names an
                ``OnExit`` job.
            StoreError: the claim could not be written; nothing runs.
        """
        check_text(job_id, "job_id")
        job = await self.store.get_job(job_id)
        if isinstance(job.schedule, OnExit):
            raise InvalidArgumentError(
                f"job_id {job_id!r} is an on-exit job: it fires once, when its command exits, so it is not "
                "run now (that would fire it twice); wait for its command, or remove the job (that ends the "
                "command)"
            )
        if not floats(job) and not self.store.owns(job):
            raise JobOwnedElsewhereError(
                f"job_id {job_id!r} runs only on engine {job.owner!r}, which added it; run it there"
            )
        async with self._run_now_locks.hold(job_id):  # two calls at once: one claim at a time
            while (busy := self.timer.running.get(job_id)) is not None:
                await busy.ended.wait()
            run = await self.timer.claim_and_start(job_id, self._wall(), forced=True)
        if run is None:
            return None
        await run.ended.wait()
        if run.removed:
            raise JobNotFoundError(f"job_id {job_id!r} was removed during its run; nothing fired")
        return run.fire_id

    # -- change notifications ----------------------------------------------------------------------

    async def notify_jobs_changed(self) -> None:
        """Wake the timer and await ``on_jobs_changed`` with the complete current job list.

        On a fleet store the handler sees this engine's own jobs only (``JobStore.owns``), and a
        ``Command`` run here whose job another engine removed is ended.

        Cancellation: a handler call under way may be interrupted; the next call sees the whole set again.
        """
        self.timer.jobs_changed()
        if self.on_jobs_changed is None and not self.timer.run_scopes:
            await trio.lowlevel.checkpoint()
            return
        async with self._notify_lock:
            jobs = await self.store.list_jobs()
            ids = {job.id for job in jobs}
            for job_id, scope in list(self.timer.run_scopes.items()):
                if job_id not in ids:  # removed elsewhere: a removed job never fires
                    scope.cancel()
            if self.on_jobs_changed is not None:
                await self.on_jobs_changed([job for job in jobs if self.store.owns(job)])

    # -- delivery (shared with the exit watchers) ---------------------------------------------------

    async def fire_pending(self, job_id: str, pending_fire: PendingFire) -> FiredEvent | None:
        """Record and deliver a committed fire of ``job_id`` (see :class:`Delivery`), then delete a
        one-shot job with ``delete_after_run``.

        Failed store writes are retried (1 s, 5 s, 30 s, then every 5 min). Embedded, if ``on_fire``
        raises, the error is logged and the event, unacknowledged, is handed over again with back-off
        while the engine runs, and at the next start.

        Returns:
            The event, or ``None`` if the job was removed (nothing logged) or ``on_fire`` raised.

        Cancellation: the fire stays pending (or its event unacknowledged), delivered at the next start.
        """
        try:
            event = await self.delivery.record(job_id, pending_fire)
        except JobNotFoundError:
            logger.info("cron job %s was removed; its fire %s is not delivered", job_id, pending_fire.fire_id)
            return None
        handed = await self.delivery.hand_over(event)
        await self.timer.delete_if_done(job_id)
        return event if handed else None

    async def notify(self, job_id: str, project: str | None, fire: PendingFire) -> FiredEvent | None:
        """Deliver a fire that belongs to no job (a subprocess's exit notice, ``_notices``): persist it,
        record it in the event log, and (embedded) hand it to ``on_fire``, as :meth:`fire_pending` does.

        Cancellation: once persisted, the notice is recorded and delivered at the next start.

        Returns:
            The event, or ``None`` when the store keeps no notices (logged) or ``on_fire`` raised (it is
            handed over again later).
        """
        store = self.store
        if not isinstance(store, NoticeStore):
            await trio.lowlevel.checkpoint()
            logger.error("the job store %s keeps no exit notices; %s is not sent", store.describe(), job_id)
            return None
        await self.retry.run(
            f"persisting exit notice {fire.fire_id} of {job_id}",
            functools.partial(store.add_notice, job_id, project, fire),
            logger=logger,
        )
        event = await self.delivery.record_notice(store, fire.fire_id)
        if event is None:
            return None
        return event if await self.delivery.hand_over(event) else None

    # -- the service's life -------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Recover from the last run of the engine, then run the timer until cancelled.

        Start-up: jobs left ``RUNNING`` become ``INTERRUPTED`` (their due time stays consumed),
        ``on_jobs_changed`` sees the job list once; then, before the timer starts, every pending fire left
        by a crash is recorded and (embedded) every unacknowledged event handed to ``on_fire`` again, in
        cursor order.

        Cancellation: the timer and every run stop; ``Command`` children are ended by escalation.
        """
        async with trio.open_nursery() as nursery:
            self._nursery = self.timer.nursery = nursery
            try:
                self.delivery.add_observer(lambda _event: self._events_appended())
                await nursery.start(self.delivery.run)
                await nursery.start(self.store.listen, self._jobs_changed_elsewhere, self._events_appended)
                now = self._wall()
                for job in await self.store.list_jobs():
                    if job.last_status is JobStatus.RUNNING and self.store.owns(job):
                        await self.store.update_job(job.id, lambda j: interrupted(j, now))
                pending = await self.store.pending_fires()
                await self.notify_jobs_changed()
                task_status.started()
                await self._recover(pending)
                with self._timer_scope:
                    await self.timer.run()
                await trio.sleep_forever()  # stopped (stop_timer): runs under way go on until the close
            finally:
                self._nursery = self.timer.nursery = None

    def stop_timer(self) -> None:
        """Start nothing more that falls due: the first step of an engine's stop (``serve``'s, before it
        ends every child with a grace period; ``open_engine``'s exit).

        Runs and deliveries under way go on until the service closes (a ``Command`` run then shows
        ``interrupted``). A job that falls due from now on is not claimed, so it is still due when the
        next engine starts, and runs once then (missed runs run once), where it used to start during
        the stop's grace period only to be ended at once, with its due time spent. ``run_now`` still
        works (a stopping ``serve`` takes no such request). Idempotent.
        """
        self._timer_scope.cancel()

    async def _recover(self, pending: builtins.list[tuple[CronJob, PendingFire]]) -> None:
        """Start-up delivery, before the timer runs: the fires a stopped engine left behind, in order.

        Every pending fire is recorded (standalone: delivered), then the delivery catches up with the
        events the last engine left unacknowledged (:meth:`Delivery.catch_up`).
        """
        for job, fire in pending:
            with contextlib.suppress(JobNotFoundError):
                await self.delivery.record(job.id, fire)
            await self.timer.delete_if_done(job.id)
        if isinstance(self.store, NoticeStore):  # exit notices persisted and not recorded yet
            for fire_id in await self.store.pending_notices():
                await self.delivery.record_notice(self.store, fire_id)
        await self.delivery.catch_up()

    def _jobs_changed_elsewhere(self) -> None:
        """Another engine changed the jobs: wake the timer, and reconcile (in the nursery) if asked to."""
        self.timer.jobs_changed()
        wanted = self.on_jobs_changed is not None or self.timer.run_scopes
        if self._nursery is not None and wanted and not self._reconcile_pending:
            self._reconcile_pending = True  # one reconcile for a burst of changes
            self._nursery.start_soon(self._notify_quietly)

    async def _notify_quietly(self) -> None:
        try:
            self._reconcile_pending = False
            await self.notify_jobs_changed()
        except Exception:
            logger.exception("cron: reconciling the jobs another engine changed failed")


@asynccontextmanager
async def open_cron_service(
    *,
    state_dir: str,
    supervisor: Supervisor,
    store: JobStore | None = None,
    now: Callable[[], datetime] | None = None,
    on_fire: FireHandler | None = None,
    on_jobs_changed: JobsChangedHandler | None = None,
    fire_observers: Iterable[FireObserver] = (),
    engine_id: str | None = None,
    log_cap_bytes: int = 50 * 2**20,
) -> AsyncIterator[CronService]:
    """Open the store, start a :class:`CronService` (start-up recovery done), and stop it on exit.

    Args:
        state_dir: the engine's state directory.
        supervisor: runs ``Command`` payloads; it must outlive the block.
        store: the job store (``None``: :class:`SqliteJobStore` at ``<state_dir>/cron.sqlite3``).
        now: the wall clock (``None``: the system's, aware UTC).
        on_fire: awaited with each delivered event (embedded hosts).
        on_jobs_changed: see :attr:`CronService.on_jobs_changed`.
        fire_observers: called with each event as it is recorded in the event log (``serve`` logs it).
        engine_id: this engine's id (the ``owner`` of the jobs it adds).
        log_cap_bytes: the size each log of a running ``Command`` keeps on disk, in bytes
            (``EngineConfig.log_cap_bytes``).

    Cancellation: leaving the block stops the timer and every run (``Command`` children ended), then
    closes the store under a shield.

    Raises:
        StoreError: the store cannot be opened or read at start-up.
    """
    store = store if store is not None else SqliteJobStore.in_state_dir(state_dir)
    await store.open()
    try:
        async with trio.open_nursery() as nursery:
            service = CronService(
                store=store,
                supervisor=supervisor,
                state_dir=state_dir,
                now=now if now is not None else utc_now,
                delivery=Delivery(store, on_fire=on_fire, observers=list(fire_observers)),
                on_jobs_changed=on_jobs_changed,
                engine_id=engine_id,
                log_cap_bytes=log_cap_bytes,
            )
            await nursery.start(service.run)
            try:
                yield service
            finally:
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await store.aclose()
