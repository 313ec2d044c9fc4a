"""Delivery of fires (``engine/cron/_delivery.py``) over a real SQLite store, under the autojump clock."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import pytest
import trio
import trio.testing
from trio.testing import wait_all_tasks_blocked as wait_all_blocked

from engine import FiredEvent, OnExit, SqliteJobStore, Supervisor, SystemEvent
from engine.cron import open_cron_service
from engine.cron._delivery import Delivery
from engine.cron._events import text_fire

from .test_cron_store import FullDiskConnection, exited, job


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteJobStore]:
    s = SqliteJobStore.in_state_dir(str(tmp_path))
    await s.open()
    try:
        await s.insert_job(job("j"))
        yield s
    finally:
        await s.aclose()


async def test_delivery_standalone_logs_acked_and_observers_see_each_event(store: SqliteJobStore) -> None:
    seen: list[FiredEvent] = []
    delivery = Delivery(store, observers=[seen.append])
    fire = text_fire("j", "hello")
    await store.commit_fire("j", exited, fire)
    event = await delivery.record("j", fire)
    assert seen == [event] and event.fire_id == fire.fire_id
    assert await store.unacked_events() == [] and await store.pending_fires() == []
    assert await delivery.hand_over(event)  # standalone: the log is the delivery


async def test_delivery_observer_that_fails_does_not_stop_delivery(
    store: SqliteJobStore, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[FiredEvent] = []

    def broken(event: FiredEvent) -> None:
        raise RuntimeError("observer bug")

    delivery = Delivery(store)
    delivery.add_observer(broken)
    delivery.add_observer(seen.append)
    event = await delivery.record("j", text_fire("j", "still delivered"))
    assert seen == [event] and await store.events() == [event]
    assert "observer of fire" in caplog.text and "observer bug" in caplog.text


async def test_delivery_embedded_redelivers_in_cursor_order_with_back_off(
    store_clock: trio.testing.MockClock, store: SqliteJobStore
) -> None:
    calls: list[tuple[float, int]] = []
    down = True

    async def on_fire(event: FiredEvent) -> None:
        calls.append((trio.current_time(), event.cursor))
        if down:
            raise RuntimeError("host is down")

    delivery = Delivery(store, on_fire=on_fire)
    async with trio.open_nursery() as nursery:
        await nursery.start(delivery.run)
        start = trio.current_time()
        first = await delivery.record("j", text_fire("j", "one"))
        assert not await delivery.hand_over(first)
        second = await delivery.record("j", text_fire("j", "two"))
        assert not await delivery.hand_over(second)
        assert await store.unacked_events() == [first, second]
        await trio.sleep(10)  # passes after 1 s and 5 s more, both refused
        down = False
        await trio.sleep(30)  # the next pass, 30 s later, is accepted
        assert await store.unacked_events() == []
        nursery.cancel_scope.cancel()
    passes = [(round(t - start), c) for t, c in calls[2:]]
    assert passes == [(1, 1), (1, 2), (6, 1), (6, 2), (36, 1), (36, 2)]  # each pass in cursor order


async def test_removed_job_committed_fire_reaches_the_observers(
    tmp_path: Path, supervisor: Supervisor
) -> None:
    seen: list[FiredEvent] = []
    async with open_cron_service(
        state_dir=str(tmp_path), supervisor=supervisor, fire_observers=[seen.append]
    ) as cron:
        added = await cron.add(OnExit("true", cwd=str(tmp_path)), SystemEvent("done"), enabled=False)
        fire = text_fire(added.name, "exited before the removal")
        await cron.store.commit_fire(added.id, exited, fire)
        await cron.remove(added.id)
        assert [e.fire_id for e in seen] == [fire.fire_id]
        assert await cron.events() == seen


class AckCountingStore(SqliteJobStore):
    """The real store, keeping each ``ack_events`` transaction; while ``gate`` is set, the first one
    waits for it (a slow disk under the first ack)."""

    acks: list[tuple[int, ...]]
    gate: trio.Event | None = None

    async def ack_events(self, cursors: Iterable[int]) -> None:
        batch = tuple(cursors)
        gate, self.gate = self.gate, None
        if gate is not None:
            await gate.wait()
        await super().ack_events(batch)
        self.acks.append(batch)


@pytest.fixture
async def counting_store(tmp_path: Path) -> AsyncIterator[AckCountingStore]:
    s = AckCountingStore(str(tmp_path / "cron.sqlite3"))
    s.acks = []
    await s.open()
    try:
        await s.insert_job(job("j"))
        yield s
    finally:
        await s.aclose()


async def _record(delivery: Delivery, count: int) -> list[FiredEvent]:
    return [await delivery.record("j", text_fire("j", f"fire {i}")) for i in range(count)]


async def test_delivery_acks_fires_handed_over_together_in_few_commits(
    counting_store: AckCountingStore,
) -> None:
    handed: list[int] = []

    async def on_fire(event: FiredEvent) -> None:
        handed.append(event.cursor)

    delivery = Delivery(counting_store, on_fire=on_fire)
    events = await _record(delivery, 60)
    results: list[bool] = []

    async def hand(event: FiredEvent) -> None:
        results.append(await delivery.hand_over(event))

    async with trio.open_nursery() as nursery:
        for event in events:
            nursery.start_soon(hand, event)
    assert results == [True] * 60 and sorted(handed) == [e.cursor for e in events]
    assert await counting_store.unacked_events() == []
    acked = [c for batch in counting_store.acks for c in batch]
    assert sorted(acked) == [e.cursor for e in events]  # each once
    assert len(counting_store.acks) <= 3  # the first alone, the rest while it was written


async def test_delivery_ack_batch_whose_writer_is_cancelled_is_written_by_another(
    counting_store: AckCountingStore,
) -> None:
    delivery = Delivery(counting_store, on_fire=lambda _event: trio.lowlevel.checkpoint())
    first, second, third = await _record(delivery, 3)
    gate = counting_store.gate = trio.Event()
    results: dict[int, bool] = {}

    async def hand(event: FiredEvent) -> None:
        results[event.cursor] = await delivery.hand_over(event)

    scope = trio.CancelScope()

    async def hand_cancelled() -> None:
        with scope:
            await hand(second)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hand, first)  # writes the first batch, held at the gate
        await wait_all_blocked()
        nursery.start_soon(hand_cancelled)  # leads the second batch, waiting for the first to be written
        await wait_all_blocked()
        nursery.start_soon(hand, third)  # joins the second batch
        await wait_all_blocked()
        scope.cancel()  # the second batch's writer gives up before writing it
        await wait_all_blocked()
        assert results == {}
        gate.set()
    assert results == {first.cursor: True, third.cursor: True}
    assert await counting_store.unacked_events() == [second]  # handed over again later: at least once
    assert [c for batch in counting_store.acks for c in batch if c != second.cursor] == [
        first.cursor,
        third.cursor,
    ]


async def test_delivery_held_hand_overs_do_not_wait_for_an_ack_another_writes(
    counting_store: AckCountingStore,
) -> None:
    """The timer's claimed burst (``hand_over_held``): once ``on_fire`` returned, a hand-over that joins
    an acknowledgement another one writes returns ``None`` at once, and is told when it committed."""
    handed: list[int] = []

    async def on_fire(event: FiredEvent) -> None:
        handed.append(event.cursor)

    delivery = Delivery(counting_store, on_fire=on_fire)
    events = await _record(delivery, 60)
    gate = counting_store.gate = trio.Event()
    results: dict[int, bool | None] = {}
    told: dict[int, bool] = {}

    async def hand(event: FiredEvent) -> None:
        delivery.hold(event)
        results[event.cursor] = await delivery.hand_over_held(
            event, lambda acked: told.update({event.cursor: acked})
        )

    async with trio.open_nursery() as nursery:
        for event in events:
            nursery.start_soon(hand, event)
        await wait_all_blocked()  # the first ack is held at the gate
        returned = [c for c, r in results.items() if r is None]
        assert len(returned) >= 57 and told == {}  # returned without waiting; the writers wait
        gate.set()
    assert sorted(handed) == [e.cursor for e in events]
    assert sorted(c for c, r in results.items() if r) == sorted(set(handed) - set(returned))
    assert told == dict.fromkeys(returned, True)  # each told once, once its batch committed
    assert await counting_store.unacked_events() == []
    acked = [c for batch in counting_store.acks for c in batch]
    assert sorted(acked) == [e.cursor for e in events] and len(counting_store.acks) <= 3


async def test_delivery_held_hand_overs_of_a_cancelled_writer_are_told_and_redelivered(
    store_clock: trio.testing.MockClock, counting_store: AckCountingStore
) -> None:
    calls: list[int] = []

    async def on_fire(event: FiredEvent) -> None:
        calls.append(event.cursor)

    delivery = Delivery(counting_store, on_fire=on_fire)
    first, second, third = await _record(delivery, 3)
    gate = counting_store.gate = trio.Event()
    told: dict[int, bool] = {}
    scope = trio.CancelScope()

    async def hand(event: FiredEvent) -> None:
        delivery.hold(event)
        try:
            await delivery.hand_over_held(event, lambda acked: told.update({event.cursor: acked}))
        finally:
            delivery.release(event)

    async def hand_cancelled() -> None:
        with scope:
            await hand(second)

    async with trio.open_nursery() as nursery:
        await nursery.start(delivery.run)
        nursery.start_soon(hand, first)  # writes the first batch, held at the gate
        await wait_all_blocked()
        nursery.start_soon(hand_cancelled)  # leads the second batch, waiting for the first
        await wait_all_blocked()
        nursery.start_soon(hand, third)  # joins the second batch and returns
        await wait_all_blocked()
        assert told == {}
        scope.cancel()  # the second batch's writer gives up before writing it
        await wait_all_blocked()
        assert told == {third.cursor: False}  # told, and left to a redelivery pass
        gate.set()
        await trio.sleep(5)  # the pass after 1 s
        nursery.cancel_scope.cancel()
    assert await counting_store.unacked_events() == []  # at least once: each handed over and acked
    assert calls[:3] == [first.cursor, second.cursor, third.cursor]
    assert sorted(calls[3:]) == [second.cursor, third.cursor]


async def test_delivery_group_ack_on_a_failing_disk_is_retried_and_loses_nothing(
    store_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    store = SqliteJobStore(str(tmp_path / "cron.sqlite3"), connection_factory=FullDiskConnection)
    await store.open()
    calls: list[int] = []

    async def on_fire(event: FiredEvent) -> None:
        calls.append(event.cursor)

    try:
        await store.insert_job(job("j"))
        delivery = Delivery(store, on_fire=on_fire)
        events = await _record(delivery, 40)
        results: list[bool] = []

        async def hand(event: FiredEvent) -> None:
            results.append(await delivery.hand_over(event))

        FullDiskConnection.armed = True
        try:
            async with trio.open_nursery() as nursery:
                for event in events:
                    nursery.start_soon(hand, event)
                await trio.sleep(3)  # the ack writes fail, and are retried after 1 s, 5 s
                assert results == [] and len(await store.unacked_events()) == 40
                FullDiskConnection.armed = False
        finally:
            FullDiskConnection.armed = False
        assert results == [True] * 40
        assert sorted(calls) == [e.cursor for e in events]  # on_fire once each: only the ack was retried
        assert await store.unacked_events() == []
    finally:
        await store.aclose()
