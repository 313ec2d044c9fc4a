"""Delivery of fires: the event log, ``on_fire``, acknowledgement, redelivery (docs/design.md, invariant 5).

A committed fire (a :class:`PendingFire` on its job's row) is *recorded*: appended to the event log as a
:class:`FiredEvent`, in the transaction that clears the job's pending fire. What happens next depends on
the engine:

- **standalone** (no ``on_fire``): the event is appended acknowledged; the log is the delivery, exactly
  once.
- **embedded**: the event is appended unacknowledged, ``on_fire`` is awaited, then the event is
  acknowledged; the acknowledgements of fires handed over together are written in one transaction
  (group commit), each hand-over returning once its own is committed. If ``on_fire`` raises, the event
  stays unacknowledged and every unacknowledged event is handed over again, in cursor order, after 1 s,
  5 s, 30 s, then every 5 min (the engine's :class:`RetryPolicy`) while the engine runs, and at the next
  start: at least once, with a stable ``fire_id``.

Observers (``serve`` logs ``fired`` through one) see every event as it is recorded.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import final

import attrs
import trio

from .._retry import RetryPolicy
from ._events import FiredEvent, PendingFire
from ._notices import NoticeStore
from ._protocol import JobStore

__all__ = ["Delivery", "FireHandler", "FireObserver"]

logger = logging.getLogger("engine.cron")

#: ``on_fire`` handlers: awaited with each delivered event (embedded hosts).
FireHandler = Callable[[FiredEvent], Awaitable[None]]
#: Observers: called with each event as it is recorded in the event log (must not block).
FireObserver = Callable[[FiredEvent], None]


def _set(event: trio.Event) -> trio.Event:
    event.set()
    return event


class _UndeliveredError(Exception):
    """Raised by a redelivery pass that left an event unacknowledged (the pass is retried)."""


@final
@attrs.define(eq=False)
class _AckBatch:
    """The cursors acknowledged together in one store transaction (group commit).

    Attributes:
        cursors: the events whose ``on_fire`` returned, acknowledged by this batch's commit.
        told: called once the batch ended, with whether it committed (the timer's claimed events,
            whose tasks did not wait: :meth:`Delivery.hand_over_held`).
        led: whether a hand-over has taken the commit on (it waits for the batch before to end).
        done: set once the commit ended, committed or not.
        committed: whether the commit went through.
    """

    cursors: list[int] = attrs.field(factory=list)
    told: list[Callable[[bool], None]] = attrs.field(factory=list)
    led: bool = False
    done: trio.Event = attrs.field(factory=trio.Event)
    committed: bool = False


@final
@attrs.define(eq=False)
class Delivery:
    """Records committed fires, hands them to ``on_fire``, acknowledges them and redelivers refused ones.

    One per cron service; its :meth:`run` task (in the service's nursery) does the redelivery.

    Attributes:
        store: the job store holding the event log.
        on_fire: awaited with each recorded event (embedded hosts), or ``None`` (standalone).
        retry: the waits between store attempts and between redelivery passes.
        observers: called with each event as it is recorded; an observer that raises is logged.
    """

    store: JobStore
    on_fire: FireHandler | None = None
    retry: RetryPolicy = attrs.field(factory=RetryPolicy)
    observers: list[FireObserver] = attrs.field(factory=list)
    _handing: set[int] = attrs.field(init=False, factory=set)
    _failed: trio.Event = attrs.field(init=False, factory=trio.Event)
    _pass_lock: trio.Lock = attrs.field(init=False, factory=trio.Lock)
    _acked_in_pass: set[int] | None = attrs.field(init=False, default=None)
    _acking: _AckBatch = attrs.field(init=False, factory=_AckBatch)
    _ack_lock: trio.Lock = attrs.field(init=False, factory=trio.Lock)
    _acks_open: trio.Event = attrs.field(init=False, factory=lambda: _set(trio.Event()))

    def __repr__(self) -> str:
        mode = "standalone" if self.on_fire is None else "embedded"
        waiting = ", redelivery due" if self._failed.is_set() else ""
        return f"<Delivery {mode}: {len(self._handing)} handing over{waiting}>"

    def defer_acks(self, deferred: bool) -> None:
        """While ``deferred``, acknowledgements wait (each hand-over still returns only once its own is
        committed); then they are written together. The timer defers them while it claims a burst
        batch after batch, so that its claims, which come before the next fires, do not queue behind
        acknowledgement commits on the store's one connection."""
        if not deferred:
            self._acks_open.set()
        elif self._acks_open.is_set():
            self._acks_open = trio.Event()

    def add_observer(self, observer: FireObserver) -> None:
        """Call ``observer(event)`` for every event recorded from now on."""
        self.observers.append(observer)

    def _observe(self, event: FiredEvent) -> None:
        for observer in self.observers:
            try:
                observer(event)
            except Exception:
                logger.exception("cron: an observer of fire %s failed", event.fire_id)

    async def record(self, job_id: str, fire: PendingFire) -> FiredEvent:
        """Append ``fire`` to the event log, clearing the job's pending fire, retrying store failures.

        Standalone the event is appended acknowledged (delivered); embedded, unacknowledged, for
        :meth:`hand_over`. A fire logged before (same ``fire_id``) is not appended again. Observers see
        the event.

        Cancellation: the fire stays pending (or its event unacknowledged), delivered at the next start.

        Returns:
            The logged event.

        Raises:
            JobNotFoundError: the job was removed; nothing is logged.
        """
        append = self.store.deliver_fire if self.on_fire is None else self.store.record_event
        event = await self.retry.run(
            f"cron job {job_id}: recording fire {fire.fire_id}",
            functools.partial(append, job_id, fire),
            logger=logger,
        )
        self._observe(event)
        return event

    async def record_notice(self, store: NoticeStore, fire_id: str) -> FiredEvent | None:
        """Append a persisted exit notice to the event log, deleting the notice, retrying store failures
        (``_notices``); standalone acknowledged, embedded for :meth:`hand_over`. Observers see it.

        Cancellation: the notice stays kept, recorded at the next start.

        Returns:
            The logged event, or ``None`` when the notice is not kept (recorded already).
        """
        event = await self.retry.run(
            f"recording exit notice {fire_id}",
            functools.partial(store.record_notice, fire_id, acked=self.on_fire is None),
            logger=logger,
        )
        if event is not None:
            self._observe(event)
        return event

    @contextlib.contextmanager
    def holding(self, event: FiredEvent | None) -> Iterator[None]:
        """Keep redelivery passes off ``event``, which the caller logged itself and will
        :meth:`hand_over` inside the block (a removed job's last fire). Observers see it at once.
        """
        if event is None:
            yield
            return
        self.hold(event)
        try:
            yield
        finally:
            self.release(event)

    def hold(self, event: FiredEvent) -> None:
        """:meth:`holding` without a block, for an event handed over in another task: observers see it
        now and redelivery passes keep off it until :meth:`release` (the timer's claims, from the claim
        on: no pass can take an event between its claim and its hand-over)."""
        self._observe(event)
        self._handing.add(event.cursor)

    def release(self, event: FiredEvent) -> None:
        """End a :meth:`hold`: the event is the redelivery passes' again if it is not acknowledged."""
        self._handing.discard(event.cursor)

    async def hand_over(self, event: FiredEvent) -> bool:
        """Embedded: await ``on_fire(event)`` and acknowledge the event (retrying the store write).

        If ``on_fire`` raises, the error is logged, the event stays unacknowledged and a redelivery is
        scheduled. Standalone there is nothing to hand over: the log is the delivery.

        Cancellation: the event stays unacknowledged, handed over again later or at the next start.

        Returns:
            Whether the event is delivered (``on_fire`` returned, or standalone).
        """
        if self.on_fire is None:
            await trio.lowlevel.checkpoint()
            return True
        self._handing.add(event.cursor)
        try:
            try:
                await self.on_fire(event)
            except Exception:
                self._refused(event)
                return False
            await self._acknowledge(event.cursor)
            if self._acked_in_pass is not None:
                self._acked_in_pass.add(event.cursor)
            return True
        finally:
            self._handing.discard(event.cursor)

    async def hand_over_held(self, event: FiredEvent, then: Callable[[bool], None]) -> bool | None:
        """:meth:`hand_over` for an event the caller holds (:meth:`hold`; the timer's claims), without
        waiting for an acknowledgement another hand-over writes.

        ``on_fire(event)`` is awaited. If an acknowledgement is being written by another hand-over, the
        event joins the next one and this returns ``None`` at once: ``then(acknowledged)`` is called
        once that one ended (``False``: its writer was cancelled; the event is handed over again by a
        redelivery pass). Otherwise this writes it and returns, as :meth:`hand_over` does, and ``then``
        is not called. A burst of a thousand fires thus leaves no thousand tasks waiting for a commit
        (their stacks are what set off a full garbage collection inside a burst).

        Cancellation: as :meth:`hand_over`; ``then`` is not called.

        Returns:
            Whether the event is delivered (``on_fire`` returned and the acknowledgement committed, or
            standalone), or ``None``: ``then`` will tell.
        """
        if self.on_fire is None:
            await trio.lowlevel.checkpoint()
            return True
        try:
            await self.on_fire(event)
        except Exception:
            self._refused(event)
            return False
        acked = await self._acknowledge(event.cursor, then=then)
        if acked and self._acked_in_pass is not None:
            self._acked_in_pass.add(event.cursor)
        return acked

    def _refused(self, event: FiredEvent) -> None:
        logger.exception(
            "cron job %s: on_fire failed for fire %s (cursor %s); it is handed over again later "
            "(with back-off, and at the next start)",
            event.job_id,
            event.fire_id,
            event.cursor,
        )
        self._failed.set()

    async def _acknowledge(self, cursor: int, *, then: Callable[[bool], None] | None = None) -> bool | None:
        """Acknowledge the event at ``cursor`` in the store; return once that is committed.

        Group commit: the hand-overs whose ``on_fire`` returned while one acknowledgement is being
        written wait for it to end and are then written together, in one transaction (1000 fires of one
        second cost a few commits, not 1000). The first of a batch writes it; a failed write is retried
        (1 s, 5 s, 30 s, then every 5 min) and the batch's other hand-overs wait for it. If the writer is
        cancelled first, each of them takes its cursor into a later batch.

        With ``then``, a hand-over that is not the writer does not wait: ``then(committed)`` is called
        when the batch ended, and this returns ``None`` (:meth:`hand_over_held`).

        Cancellation: the event may stay unacknowledged (handed over again later or at the next start).

        Returns:
            ``True`` once committed, or ``None`` when ``then`` will tell.
        """
        while True:
            batch = self._acking
            batch.cursors.append(cursor)
            if batch.led and then is not None:
                batch.told.append(then)
                return None
            if batch.led:
                await batch.done.wait()
            else:
                batch.led = True
                try:
                    while not self._acks_open.is_set():  # deferred (the timer claims a burst)
                        await self._acks_open.wait()
                    async with self._ack_lock:  # the batch before is being written; this one grows
                        if self._acking is batch:
                            self._acking = _AckBatch()
                        await self.retry.run(
                            f"cron: acknowledging {len(batch.cursors)} fire(s)",
                            functools.partial(self.store.ack_events, tuple(batch.cursors)),
                            logger=logger,
                        )
                        batch.committed = True
                finally:
                    if self._acking is batch:  # cancelled before the batch was closed
                        self._acking = _AckBatch()
                    batch.done.set()
                    self._tell(batch)
            if batch.committed:
                return True

    def _tell(self, batch: _AckBatch) -> None:
        """Call the batch's ``told`` (each logged if it raises); a batch not committed leaves its events
        to a redelivery pass."""
        if not batch.committed and batch.told:
            self._failed.set()
        elif batch.committed and self._acked_in_pass is not None:
            self._acked_in_pass.update(batch.cursors)  # a pass under way must not hand them over again
        for tell in batch.told:
            try:
                tell(batch.committed)
            except Exception:
                logger.exception("cron: ending a hand-over after its acknowledgement failed")

    async def catch_up(self) -> None:
        """Start-up, once the pending fires are recorded: deliver what the last engine left undelivered.

        Embedded, every unacknowledged event is handed to ``on_fire`` in cursor order. Standalone, the
        log is the delivery, so events an embedded engine left unacknowledged count as delivered.

        Cancellation: what is not acknowledged yet is delivered at the next start.
        """
        if self.on_fire is not None:
            await self._hand_over_unacked()
            return
        unacked = await self.retry.run(
            "cron start-up: reading the unacknowledged events", self.store.unacked_events, logger=logger
        )
        if unacked:
            await self.retry.run(
                "cron start-up: acknowledging the events",
                functools.partial(self.store.ack_events, [e.cursor for e in unacked]),
                logger=logger,
            )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Redeliver after each failed hand-over, until cancelled.

        After a failure, every unacknowledged event is handed over again in cursor order, with the
        policy's back-off between passes, until a pass leaves none unacknowledged. Idle otherwise.

        Cancellation: stops; the events not acknowledged are delivered at the next start.
        """
        task_status.started()
        while True:
            await self._failed.wait()
            await self.retry.run(
                "cron: handing the unacknowledged events to on_fire again",
                self._redeliver_pass,
                retry_on=_UndeliveredError,
                logger=logger,
                failures=1,  # the hand-over that failed
            )

    async def _redeliver_pass(self) -> None:
        self._failed = trio.Event()
        await self._hand_over_unacked()
        if self._failed.is_set():  # in this pass, or a new fire meanwhile
            raise _UndeliveredError("an event is still not acknowledged")

    async def _hand_over_unacked(self) -> None:
        """Hand every unacknowledged event (not being handed over now) to ``on_fire`` in cursor order.

        An event ``on_fire`` refuses does not hold back the ones after it (one bad event must not stop
        delivery); it schedules a redelivery, as a failure to read the events does.
        """
        async with self._pass_lock:  # one pass at a time
            try:
                events = await self.store.unacked_events()
            except OSError as exc:
                logger.error("cron: reading the unacknowledged events failed (%s)", exc)
                self._failed.set()
                return
            self._acked_in_pass = set()
            try:
                for event in events:  # skip those handed over (or acked) by a fire meanwhile
                    if event.cursor not in self._handing and event.cursor not in self._acked_in_pass:
                        await self.hand_over(event)
            finally:
                self._acked_in_pass = None
