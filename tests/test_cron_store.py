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
    JobStore,
    OnExit,
    SqliteJobStore,
    StoreError,
    SystemEvent,
)
from engine.cron._events import exit_fire, text_fire
from engine.cron._job import JobStatus
from engine.cron._pg_store import PostgresJobStore
from engine.cron._store import SQLITE_CLAIM_BATCH
from engine.cron._watch_state import ArmIntent, WatchState

T0 = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)


class FullDiskConnection(sqlite3.Connection):
    """A connection whose writes fail with ENOSPC while ``armed`` (a full disk, at the edge)."""

    armed = False

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        verb = sql.lstrip().split(None, 1)[0].upper()
        if type(self).armed and verb in {"INSERT", "UPDATE", "DELETE", "COMMIT"}:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().execute(sql, *args)


#: The engine the stores of these tests belong to (the owner of the jobs they add).
ENGINE = "engine-a"


@pytest.fixture
async def sqlite_store(tmp_path: Path) -> AsyncIterator[SqliteJobStore]:
    s = SqliteJobStore.in_state_dir(str(tmp_path))
    await s.open()
    try:
        yield s
    finally:
        await s.aclose()


@pytest.fixture(params=["sqlite", "postgresql"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[JobStore]:
    """Each store in turn: the protocol's tests run on both (PostgreSQL: a real server, a fresh database)."""
    if request.param == "sqlite":
        s: JobStore = SqliteJobStore.in_state_dir(str(tmp_path))
    else:
        s = PostgresJobStore(request.getfixturevalue("pg_url"), ENGINE)
    await s.open()
    try:
        yield s
    finally:
        await s.aclose()


def exited(j: CronJob) -> CronJob:
    """What an on-exit job's exit commits with its fire: the job disabled, no next run."""
    return attrs.evolve(j, enabled=False, next_run_at=None)


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
        owner=ENGINE,
    )
    return attrs.evolve(base, **kw)


async def test_store_round_trips_every_kind_of_job(tmp_path: Path, sqlite_store: JobStore) -> None:
    jobs = [
        job("a"),
        job("b", schedule=At(T0 + timedelta(days=1)), payload=Command(("echo", "x y"), cwd="/tmp")),
        job(
            "c", schedule=Cron("30 1 * * *", "America/New_York"), last_status=JobStatus.ERROR, last_error="e"
        ),
        job("d", schedule=OnExit("make test", cwd="/srv"), next_run_at=None, consecutive_errors=3),
    ]
    store = sqlite_store
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


async def test_store_uses_wal_full_sync_and_a_schema_version(tmp_path: Path, sqlite_store: JobStore) -> None:
    conn = sqlite3.connect(tmp_path / "cron.sqlite3")
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 4
    finally:
        conn.close()


#: The schema of version 1, as the engine before ``events.acked`` created it.
SCHEMA_V1 = """
CREATE TABLE jobs (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, data TEXT NOT NULL,
    pending_fire TEXT, watch_state TEXT);
CREATE TABLE events (cursor INTEGER PRIMARY KEY AUTOINCREMENT, fire_id TEXT NOT NULL UNIQUE,
    job_id TEXT NOT NULL, job_name TEXT NOT NULL, text TEXT NOT NULL, command TEXT, exit_code INTEGER,
    signal INTEGER, reason TEXT, duration_seconds REAL, stdout_tail TEXT NOT NULL, stderr_tail TEXT NOT NULL,
    truncated INTEGER NOT NULL);
PRAGMA user_version=1;
"""


async def test_store_migrates_version_1_keeping_jobs_and_events(tmp_path: Path) -> None:
    path = tmp_path / "cron.sqlite3"
    delivered, interrupted = text_fire("a", "delivered"), text_fire("b", "on_fire never returned")
    conn = sqlite3.connect(path)
    conn.executescript(SCHEMA_V1)
    for j, pending in ((job("a"), None), (job("b"), interrupted)):
        conn.execute(
            "INSERT INTO jobs (id, data, pending_fire) VALUES (?, ?, ?)",
            (j.id, json.dumps(j.to_dict()), None if pending is None else json.dumps(pending.to_dict())),
        )
    for job_id, fire in (("a", delivered), ("b", interrupted)):  # v1 embedded: logged, b not yet cleared
        conn.execute(
            "INSERT INTO events (job_id, fire_id, job_name, text, stdout_tail, stderr_tail, truncated) "
            "VALUES (?, ?, ?, ?, '', '', 0)",
            (job_id, fire.fire_id, fire.job_name, fire.text),
        )
    conn.commit()
    conn.close()
    s = SqliteJobStore(str(path))
    await s.open()
    try:
        assert [j.id for j in await s.list_jobs()] == ["a", "b"]
        events = await s.events()
        assert [e.text for e in events] == ["delivered", "on_fire never returned"]
        # events of v1 count as delivered, but for the one whose fire is still pending
        assert [e.fire_id for e in await s.unacked_events()] == [interrupted.fire_id]
        assert await s.record_event("b", interrupted) == events[1]  # recognised, not logged twice
        assert await s.pending_fires() == []
    finally:
        await s.aclose()
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 4
    finally:
        conn.close()
    s = SqliteJobStore(str(path))
    await s.open()  # a migrated file opens again as it is
    try:
        assert len(await s.events()) == 2
    finally:
        await s.aclose()


async def test_store_refuses_newer_schema(tmp_path: Path) -> None:
    path = tmp_path / "cron.sqlite3"
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version=99")
    conn.close()
    s = SqliteJobStore(str(path))
    with pytest.raises(StoreError, match="newer"):
        await s.open()


async def test_store_unknown_job_raises_job_not_found(store: JobStore) -> None:
    with pytest.raises(JobNotFoundError, match="nope"):
        await store.get_job("nope")
    with pytest.raises(JobNotFoundError):
        await store.update_job("nope", lambda j: j)
    with pytest.raises(JobNotFoundError):
        await store.delete_job("nope")
    with pytest.raises(JobNotFoundError):
        await store.commit_fire("nope", exited, text_fire("n", "t"))


async def test_store_unreadable_row_is_skipped(
    tmp_path: Path, sqlite_store: JobStore, caplog: pytest.LogCaptureFixture
) -> None:
    store = sqlite_store
    await store.insert_job(job("good"))
    conn = sqlite3.connect(tmp_path / "cron.sqlite3")
    conn.execute('INSERT INTO jobs (id, data) VALUES (\'bad\', \'{"id": "bad", "schedule": 7}\')')
    conn.execute("INSERT INTO jobs (id, data) VALUES ('junk', 'not json at all')")
    tiny = job("tiny").to_dict()
    tiny["schedule"]["every_seconds"] = 1e-9  # written before intervals had a minimum
    conn.execute("INSERT INTO jobs (id, data) VALUES ('tiny', ?)", (json.dumps(tiny),))
    conn.commit()
    conn.close()
    assert [j.id for j in await store.list_jobs()] == ["good"]
    assert "bad" in caplog.text and "junk" in caplog.text and "tiny" in caplog.text
    with pytest.raises(JobNotFoundError, match="unreadable"):
        await store.get_job("bad")
    removed, pending = await store.delete_job("bad")  # a bad row can still be removed
    assert removed is None and pending is None


async def test_store_reads_a_row_changed_behind_it_afresh(
    tmp_path: Path, sqlite_store: JobStore, caplog: pytest.LogCaptureFixture
) -> None:
    """The store keeps each job parsed by its row's text: a row rewritten elsewhere (the file edited,
    another connection) is parsed again, never served from what was read before."""
    store = sqlite_store
    await store.insert_job(job("a"))
    await store.insert_job(job("b"))
    assert [j.name for j in await store.list_jobs()] == ["job a", "job b"]  # both parsed and kept
    due = await store.claim_due(T0 + timedelta(seconds=61), acked=True)
    assert [c.job.id for c in due.claims] == ["a", "b"]
    assert await store.list_jobs() == [c.job for c in due.claims]  # the claim's jobs are what is stored
    conn = sqlite3.connect(tmp_path / "cron.sqlite3")
    renamed = attrs.evolve(due.claims[0].job, name="renamed \udcff")
    conn.execute("UPDATE jobs SET data = ? WHERE id = 'a'", (json.dumps(renamed.to_dict()),))
    conn.execute("UPDATE jobs SET data = 'not json' WHERE id = 'b'")
    conn.commit()
    conn.close()
    assert [j.name for j in await store.list_jobs()] == ["renamed \\udcff"]  # read again, escaped
    assert (await store.get_job("a")).name == "renamed \\udcff"
    with pytest.raises(JobNotFoundError, match="unreadable"):
        await store.get_job("b")
    assert "not JSON" in caplog.text


async def test_sqlite_claims_a_burst_in_batches_of_its_own_size(sqlite_store: JobStore) -> None:
    """A burst larger than ``SQLITE_CLAIM_BATCH`` is claimed oldest first, a full batch then the rest;
    no due time is claimed twice, and each fire is logged once."""
    store = sqlite_store
    total = SQLITE_CLAIM_BATCH + 3
    for i in range(total):
        await store.insert_job(job(f"j{i:05d}", next_run_at=T0 + timedelta(seconds=60, microseconds=i)))
    now = T0 + timedelta(seconds=61)
    first = await store.claim_due(now, acked=True)
    assert first.full and len(first.claims) == SQLITE_CLAIM_BATCH
    assert [c.job.id for c in first.claims] == [f"j{i:05d}" for i in range(SQLITE_CLAIM_BATCH)]
    rest = await store.claim_due(now, acked=True)
    assert not rest.full and [c.job.id for c in rest.claims] == [
        f"j{i:05d}" for i in range(SQLITE_CLAIM_BATCH, total)
    ]
    assert (await store.claim_due(now, acked=True)).claims == []
    events = await store.events()
    assert len(events) == total == len({e.fire_id for e in events})


async def test_store_update_is_one_transaction(store: JobStore) -> None:
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
                await s.commit_fire("kept", exited, text_fire("kept", "exit"))
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


async def test_store_commit_fire_then_deliver_fire(store: JobStore) -> None:
    await store.insert_job(job("w", schedule=OnExit("true"), next_run_at=None))
    fire = text_fire("w", "the command exited")
    disabled = await store.commit_fire("w", exited, fire)
    assert not disabled.enabled
    [(pending_job, pending)] = await store.pending_fires()
    assert pending_job == disabled and pending == fire
    event = await store.deliver_fire("w", fire)
    assert event.cursor == 1 and event.fire_id == fire.fire_id and event.job_id == "w"
    assert await store.pending_fires() == []
    # delivered again (a crash replay): the same event, not a second one
    assert await store.deliver_fire("w", fire) == event
    assert await store.events() == [event]


async def test_store_record_event_clears_pending_and_stays_unacked_until_acked(
    store: JobStore,
) -> None:
    await store.insert_job(job("e"))
    first, second = text_fire("e", "one"), text_fire("e", "two")
    await store.commit_fire("e", lambda j: j, first)
    a = await store.record_event("e", first)
    assert await store.pending_fires() == []  # recorded: the job may commit its next fire
    await store.commit_fire("e", lambda j: j, second)
    b = await store.record_event("e", second)
    assert await store.unacked_events() == [a, b]  # recorded is not delivered
    assert await store.record_event("e", first) == a  # deduplicated by fire_id
    await store.ack_events([a.cursor])
    assert await store.unacked_events() == [b]
    await store.deliver_fire("e", second)  # the standalone path acks a logged event
    assert await store.unacked_events() == []
    assert await store.events() == [a, b]


async def test_store_deliver_fire_acks_at_once(store: JobStore) -> None:
    await store.insert_job(job("s"))
    event = await store.deliver_fire("s", text_fire("s", "standalone"))
    assert await store.events() == [event]
    assert await store.unacked_events() == []


@pytest.mark.parametrize("method", ["deliver_fire", "record_event"])
async def test_store_fire_of_a_removed_job_is_not_logged(store: JobStore, method: str) -> None:
    await store.insert_job(job("r"))
    fire = text_fire("r", "late")
    await store.delete_job("r")
    with pytest.raises(JobNotFoundError, match="'r'"):
        await getattr(store, method)("r", fire)
    assert await store.events() == []


async def test_store_events_since_cursor_in_order(store: JobStore, tmp_path: Path) -> None:
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


async def test_store_watch_state(store: JobStore) -> None:
    await store.insert_job(job("w", schedule=OnExit("sleep 1"), next_run_at=None))
    state = WatchState(
        arm_id="a1", pid=4242, sid=4242, start_time=123, marker="t:1", exit_file="/x",
        command="sleep 1", cwd=None, started_at=T0,
    )  # fmt: skip
    await store.set_watch_state("w", state)
    assert await store.watch_states() == {"w": state}
    await store.set_watch_state("w", None)
    assert await store.watch_states() == {}
    with pytest.raises(JobNotFoundError):
        await store.set_watch_state("gone", state)


async def test_store_watch_states_of_several_jobs_in_one_write(store: JobStore) -> None:
    for job_id in ("w1", "w2"):
        await store.insert_job(job(job_id, schedule=OnExit("sleep 1"), next_run_at=None))
    state = WatchState(
        arm_id="a1", pid=4242, sid=4242, start_time=123, marker="t:1", exit_file="/x",
        command="sleep 1", cwd=None, started_at=T0,
    )  # fmt: skip
    other = ArmIntent(arm_id="a2", exit_file="/y", command="sleep 1", cwd="/srv", started_at=T0)  # pre-spawn
    # The watchers' group commit: the jobs that exist are set, the ids naming no job are told.
    assert await store.set_watch_states({"w1": state, "gone": state, "w2": other}) == {"gone"}
    assert await store.watch_states() == {"w1": state, "w2": other}
    assert await store.set_watch_states({"w1": None, "w2": None}) == frozenset()
    assert await store.watch_states() == {}


@pytest.mark.parametrize("acked", [True, False])
async def test_store_delete_logs_the_undelivered_fire(store: JobStore, acked: bool) -> None:
    await store.insert_job(job("d"))
    fire = text_fire("d", "pending")
    await store.commit_fire("d", lambda j: j, fire)
    removed, event = await store.delete_job("d", acked=acked)
    assert removed == job("d") and event is not None and event.fire_id == fire.fire_id
    assert await store.list_jobs() == [] and await store.events() == [event]
    assert await store.unacked_events() == ([] if acked else [event])
    await store.insert_job(job("q"))
    assert await store.delete_job("q") == (job("q"), None)  # nothing pending: nothing logged
    assert len(await store.events()) == 1


async def test_store_closed_raises_store_error(tmp_path: Path) -> None:
    s = SqliteJobStore.in_state_dir(str(tmp_path))
    with pytest.raises(StoreError, match="closed"):
        await s.list_jobs()
