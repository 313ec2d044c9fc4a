"""Delivery of fires (``engine/cron/_delivery.py``) over a real SQLite store, under the autojump clock."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
import trio.testing

from engine import FiredEvent, OnExit, SqliteJobStore, Supervisor, SystemEvent
from engine.cron import open_cron_service
from engine.cron._delivery import Delivery
from engine.cron._events import text_fire

from .test_cron_store import exited, job


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
    autojump_clock: trio.testing.MockClock, store: SqliteJobStore
) -> None:
    autojump_clock.autojump_threshold = 0.05  # store calls run in a worker thread
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
