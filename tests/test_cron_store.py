"""The SQLite job store (``engine/cron/_store.py``) through real database files."""

from __future__ import annotations

import errno
import json
import sqlite3
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import attrs
import pytest

from engine import (
    At,
    Command,
    Cron,
    CronJob,
    Every,
    JobNotFoundError,
    OnExit,
    SqliteJobStore,
    StoreError,
    SystemEvent,
)
from engine.cron._events import exit_fire, text_fire
from engine.cron._job import JobStatus

T0 = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)


class FullDiskConnection(sqlite3.Connection):
    """A connection whose writes fail with ENOSPC while ``armed`` (a full disk, at the edge)."""

    armed = False

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        verb = sql.lstrip().split(None, 1)[0].upper()
        if type(self).armed and verb in {"INSERT", "UPDATE", "DELETE", "COMMIT"}:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().execute(sql, *args)


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteJobStore]:
    s = SqliteJobStore.in_state_dir(str(tmp_path))
    await s.open()
    try:
        yield s
    finally:
        await s.aclose()


def job(job_id: str = "j1", **kw: Any) -> CronJob:
    base = CronJob(
        id=job_id,
        name=f"job {job_id}",
        enabled=True,
        schedule=Every(60, anchor=T0),
        payload=SystemEvent("hello"),
        delete_after_run=False,
        created_at=T0,
        updated_at=T0,
        next_run_at=T0 + timedelta(seconds=60),
    )
    return attrs.evolve(base, **kw)


async def test_store_round_trips_every_kind_of_job(tmp_path: Path, store: SqliteJobStore) -> None:
    jobs = [
        job("a"),
        job("b", schedule=At(T0 + timedelta(days=1)), payload=Command(("echo", "x y"), cwd="/tmp")),
        job(
            "c", schedule=Cron("30 1 * * *", "America/New_York"), last_status=JobStatus.ERROR, last_error="e"
        ),
        job("d", schedule=OnExit("make test", cwd="/srv"), next_run_at=None, consecutive_errors=3),
    ]
    for j in jobs:
        await store.insert_job(j)
    assert await store.list_jobs() == jobs
    await store.aclose()
    again = SqliteJobStore.in_state_dir(str(tmp_path))
    await again.open()
    try:
        assert await again.list_jobs() == jobs
        assert await again.get_job("c") == jobs[2]
    finally:
        await again.aclose()


async def test_store_uses_wal_full_sync_and_a_schema_version(tmp_path: Path, store: SqliteJobStore) -> None:
    conn = sqlite3.connect(tmp_path / "cron.sqlite3")
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 1
    finally:
        conn.close()


async def test_store_refuses_newer_schema(tmp_path: Path) -> None:
    path = tmp_path / "cron.sqlite3"
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version=99")
    conn.close()
    s = SqliteJobStore(str(path))
    with pytest.raises(StoreError, match="newer"):
        await s.open()


async def test_store_unknown_job_raises_job_not_found(store: SqliteJobStore) -> None:
    with pytest.raises(JobNotFoundError, match="nope"):
        await store.get_job("nope")
    with pytest.raises(JobNotFoundError):
        await store.update_job("nope", lambda j: j)
    with pytest.raises(JobNotFoundError):
        await store.delete_job("nope")
    with pytest.raises(JobNotFoundError):
        await store.commit_exit("nope", text_fire("n", "t"))


async def test_store_unreadable_row_is_skipped(
    tmp_path: Path, store: SqliteJobStore, caplog: pytest.LogCaptureFixture
) -> None:
    await store.insert_job(job("good"))
    conn = sqlite3.connect(tmp_path / "cron.sqlite3")
    conn.execute('INSERT INTO jobs (id, data) VALUES (\'bad\', \'{"id": "bad", "schedule": 7}\')')
    conn.execute("INSERT INTO jobs (id, data) VALUES ('junk', 'not json at all')")
    conn.commit()
    conn.close()
    assert [j.id for j in await store.list_jobs()] == ["good"]
    assert "bad" in caplog.text and "junk" in caplog.text
    with pytest.raises(JobNotFoundError, match="unreadable"):
        await store.get_job("bad")
    removed, pending = await store.delete_job("bad")  # a bad row can still be removed
    assert removed is None and pending is None


async def test_store_update_is_one_transaction(store: SqliteJobStore) -> None:
    await store.insert_job(job())

    def explode(j: CronJob) -> CronJob:
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        await store.update_job("j1", explode)
    assert await store.get_job("j1") == job()
    changed = await store.update_job("j1", lambda j: attrs.evolve(j, name="renamed"))
    assert changed.name == "renamed" and (await store.get_job("j1")).name == "renamed"


async def test_store_failed_write_raises_store_error_and_keeps_nothing(tmp_path: Path) -> None:
    s = SqliteJobStore(str(tmp_path / "cron.sqlite3"), connection_factory=FullDiskConnection)
    await s.open()
    try:
        await s.insert_job(job("kept"))
        FullDiskConnection.armed = True
        try:
            with pytest.raises(StoreError, match="No space") as info:
                await s.insert_job(job("lost"))
            assert isinstance(info.value, OSError)
            with pytest.raises(StoreError):
                await s.commit_exit("kept", text_fire("kept", "exit"))
            with pytest.raises(StoreError):
                await s.deliver_fire("kept", text_fire("kept", "x"))
        finally:
            FullDiskConnection.armed = False
        assert [j.id for j in await s.list_jobs()] == ["kept"]
        assert (await s.get_job("kept")).enabled
        assert await s.pending_fires() == []
        assert await s.events() == []
    finally:
        await s.aclose()


async def test_store_commit_exit_then_deliver_fire(store: SqliteJobStore) -> None:
    await store.insert_job(job("w", schedule=OnExit("true"), next_run_at=None))
    fire = text_fire("w", "the command exited")
    disabled = await store.commit_exit("w", fire)
    assert not disabled.enabled
    [(pending_job, pending)] = await store.pending_fires()
    assert pending_job == disabled and pending == fire
    event = await store.deliver_fire("w", fire)
    assert event.cursor == 1 and event.fire_id == fire["fire_id"] and event.job_id == "w"
    assert await store.pending_fires() == []
    # delivered again (a crash replay): the same event, not a second one
    assert await store.deliver_fire("w", fire) == event
    assert await store.events() == [event]


async def test_store_record_event_keeps_pending_until_cleared(store: SqliteJobStore) -> None:
    await store.insert_job(job("e"))
    fire = text_fire("e", "hi")
    await store.commit_fire("e", lambda j: j, fire)
    event = await store.record_event("e", fire)
    assert len(await store.pending_fires()) == 1
    await store.clear_pending_fire("e", "another-fire-id")  # not ours: kept
    assert len(await store.pending_fires()) == 1
    await store.clear_pending_fire("e", event.fire_id)
    assert await store.pending_fires() == []
    await store.clear_pending_fire("gone", "x")  # a gone job is fine


async def test_store_events_since_cursor_in_order(store: SqliteJobStore, tmp_path: Path) -> None:
    await store.insert_job(job("e"))
    out = tmp_path / "out.log"
    out.write_text("".join(f"line {i}\n" for i in range(100)))
    fires = [text_fire("e", f"t{i}") for i in range(3)]
    fires.append(
        exit_fire("e", command="x", exit_code=3, signal=None, reason="exit", duration_seconds=1.5,
                  stdout_path=str(out), stderr_path=None)
    )  # fmt: skip
    events = [await store.record_event("e", f) for f in fires]
    assert [e.cursor for e in events] == [1, 2, 3, 4]
    assert await store.events(since=2) == events[2:]
    last = events[3]
    assert last.exit_code == 3 and last.truncated and last.stdout_tail.endswith("line 99\n")
    assert last.stdout_tail.count("\n") == 50 and last.duration_seconds == 1.5
    json.dumps(last.to_dict())


async def test_store_watch_state(store: SqliteJobStore) -> None:
    await store.insert_job(job("w", schedule=OnExit("sleep 1"), next_run_at=None))
    state = {"pid": 4242, "start_time": 123, "exit_file": "/x"}
    await store.set_watch_state("w", state)
    assert await store.watch_states() == {"w": state}
    await store.set_watch_state("w", None)
    assert await store.watch_states() == {}
    with pytest.raises(JobNotFoundError):
        await store.set_watch_state("gone", state)


async def test_store_delete_returns_undelivered_fire(store: SqliteJobStore) -> None:
    await store.insert_job(job("d"))
    fire = text_fire("d", "pending")
    await store.commit_fire("d", lambda j: j, fire)
    removed, pending = await store.delete_job("d")
    assert removed == job("d") and pending == fire
    assert await store.list_jobs() == []


async def test_store_closed_raises_store_error(tmp_path: Path) -> None:
    s = SqliteJobStore.in_state_dir(str(tmp_path))
    with pytest.raises(StoreError, match="closed"):
        await s.list_jobs()
