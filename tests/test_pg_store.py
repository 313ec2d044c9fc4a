"""The fleet store on a real PostgreSQL: claims among engines, ownership, the event stream, heartbeats,
migrations, lost connections and passwords. The protocol's own tests run on it in test_cron_store.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import attrs
import psycopg
import pytest
import trio

from engine import Command, CronJob, EngineConfig, Every, OnExit, StoreError, SystemEvent
from engine.cron._events import text_fire
from engine.cron._fleet import FleetMember
from engine.cron._pg_migrations import EVENTS_LOCK, PG_SCHEMA_VERSION
from engine.cron._pg_store import PostgresJobStore
from engine.cron._watch_state import WatchState

NOW = datetime.now(UTC)
STATE = WatchState(
    arm_id="a1", pid=4242, sid=4242, start_time=123, marker="t:1", exit_file="/x",
    command="make test", cwd="/tmp", started_at=NOW,
)  # fmt: skip


def job(job_id: str, owner: str, **kw: Any) -> CronJob:
    base = CronJob(
        id=job_id,
        name=f"job {job_id}",
        enabled=True,
        schedule=Every(3600),
        payload=SystemEvent(f"text of {job_id}"),
        delete_after_run=False,
        created_at=NOW - timedelta(hours=1),
        updated_at=NOW,
        next_run_at=NOW - timedelta(seconds=1),
        owner=owner,
    )
    return attrs.evolve(base, **kw)


@asynccontextmanager
async def stores(url: str, *ids: str, **kw: Any) -> AsyncIterator[list[PostgresJobStore]]:
    opened = [PostgresJobStore(url, engine_id, **kw) for engine_id in ids]
    async with trio.open_nursery() as nursery:  # engines of a fleet start together: one migrates
        for store in opened:
            nursery.start_soon(store.open)
    try:
        yield opened
    finally:
        for store in opened:
            await store.aclose()


async def test_pg_engines_claim_each_due_time_once(pg_url: str) -> None:
    async with stores(pg_url, "a", "b", "c") as fleet:
        for n in range(300):
            await fleet[n % 3].insert_job(job(f"j{n:03}", ("a", "b", "c")[n % 3]))
        claimed: dict[str, list[str]] = {}

        async def claim_all(store: PostgresJobStore) -> None:
            while (due := await store.claim_due(NOW, acked=True, limit=20)).claims or due.full:
                for claim in due.claims:
                    claimed.setdefault(claim.job.id, []).append(store.engine_id)

        async with trio.open_nursery() as nursery:
            for store in fleet:
                nursery.start_soon(claim_all, store)
        assert sorted(claimed) == [f"j{n:03}" for n in range(300)]
        assert all(len(engines) == 1 for engines in claimed.values())
        assert len(set().union(*claimed.values())) >= 2  # the work was shared (SKIP LOCKED)
        events = await fleet[0].events()
        assert len(events) == 300 and len({e.fire_id for e in events}) == 300
        assert sorted(e.job_id for e in events) == sorted(claimed)
        for store in fleet:  # nothing is due any more: the next due time is an hour away
            due = await store.claim_due(NOW, acked=True)
            assert due.claims == [] and due.next_due is not None and due.next_due > due.now


async def test_pg_owned_jobs_run_only_on_their_owner(pg_url: str) -> None:
    async with stores(pg_url, "a", "b") as (a, b):
        command = job("cmd", "a", payload=Command(("true",)))
        watched = job("watch", "a", schedule=OnExit("make test", cwd="/tmp"), next_run_at=None)
        await a.insert_job(command)
        await a.insert_job(watched)
        await a.set_watch_state("watch", STATE)
        assert (await b.claim_due(NOW, acked=True)).claims == []
        assert await b.watch_states() == {}
        assert b.owns(command) is False and a.owns(command) is True
        [claim] = (await a.claim_due(NOW, acked=True)).claims
        assert claim.job.id == "cmd" and claim.event is None  # a Command: claimed, run by its owner
        assert list(await a.watch_states()) == ["watch"]
        fire = text_fire("cmd", "done")
        await a.commit_fire("cmd", lambda j: j, fire)
        assert await b.pending_fires() == []  # a's fire is a's to record
        assert [f.fire_id for _, f in await a.pending_fires()] == [fire.fire_id]


async def test_pg_a_late_commit_never_hides_behind_a_later_cursor(pg_url: str) -> None:
    """Appends hold the events lock until they commit: a later append waits, so cursors follow commits."""
    async with stores(pg_url, "a", "reader") as (a, reader):
        await a.insert_job(job("j1", "a"))
        raw = psycopg.connect(pg_url)  # another engine's append, left open
        try:
            raw.execute("SELECT pg_advisory_xact_lock(%s)", (EVENTS_LOCK,))
            raw.execute(
                "INSERT INTO gadget_events (job_id, fire_id, job_name, text, stdout_tail, stderr_tail, "
                "truncated, acked, floats) VALUES ('j0', 'first', 'j0', 'first', '', '', false, true, true)"
            )
            appended = trio.Event()
            second = text_fire("j1", "second")

            async def append() -> None:
                await a.deliver_fire("j1", second)
                appended.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(append)
                await trio.sleep(0.5)
                assert not appended.is_set()  # it waits for the open append to commit
                assert await reader.events() == []
                raw.commit()
                with trio.fail_after(5):
                    await appended.wait()
        finally:
            raw.close()
        events = await reader.events()
        assert [e.fire_id for e in events] == ["first", second.fire_id]
        assert events[0].cursor < events[1].cursor


async def test_pg_concurrent_appenders_and_a_reader_that_never_skips(pg_url: str) -> None:
    async with stores(pg_url, "a", "b", "c", "reader") as (*appenders, reader):
        for store in appenders:
            for n in range(40):
                await store.insert_job(job(f"{store.engine_id}{n}", store.engine_id))
        read: list[int] = []
        done = trio.Event()

        async def follow() -> None:
            since = 0
            while not done.is_set() or (await reader.events(since)):
                for event in await reader.events(since):
                    read.append(event.cursor)
                    since = event.cursor

        async def append(store: PostgresJobStore) -> None:
            for n in range(40):
                await store.deliver_fire(f"{store.engine_id}{n}", text_fire("j", f"{n}"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(follow)
            async with trio.open_nursery() as writers:
                for store in appenders:
                    writers.start_soon(append, store)
            done.set()
        everything = [e.cursor for e in await reader.events()]
        assert len(everything) == 120
        assert read == everything  # each once, in order, none skipped


async def test_pg_heartbeats_have_ages_on_the_database_clock(pg_url: str) -> None:
    async with stores(pg_url, "a", "b", owner_lost_seconds=0.5) as (a, b):
        member = FleetMember("a", "host-a", 42, "0.1.0", "cgroup", 3, NOW, NOW)
        await a.beat(member)
        await b.beat(attrs.evolve(member, engine_id="b", host="host-b"))
        fleet = await a.fleet()
        assert [(m.engine_id, m.host, m.live_runs, m.lost) for m in fleet] == [
            ("a", "host-a", 3, False),
            ("b", "host-b", 3, False),
        ]
        await trio.sleep(0.7)
        await b.beat(attrs.evolve(member, engine_id="b", host="host-b"))
        ages = {m.engine_id: (m.age_seconds, m.lost) for m in await b.fleet()}
        assert ages["a"][0] >= 0.5 and ages["a"][1] is True
        assert ages["b"][0] < 0.5 and ages["b"][1] is False


async def test_pg_migrations_once_for_engines_starting_together_and_a_newer_schema_refused(
    pg_url: str,
) -> None:
    async with stores(pg_url, "a", "b", "c", "d"):
        pass
    with psycopg.connect(pg_url, autocommit=True) as raw:
        versions = [r[0] for r in raw.execute("SELECT version FROM gadget_schema ORDER BY version")]
        assert versions == list(range(1, PG_SCHEMA_VERSION + 1))
        raw.execute("INSERT INTO gadget_schema (version) VALUES (%s)", (PG_SCHEMA_VERSION + 1,))
    store = PostgresJobStore(pg_url, "a")
    with pytest.raises(StoreError, match="newer than this engine's"):
        await store.open()


async def test_pg_a_lost_connection_fails_the_call_and_the_next_one_connects_again(pg_url: str) -> None:
    async with stores(pg_url, "a") as (a,):
        await a.insert_job(job("j", "a"))
        with psycopg.connect(pg_url, autocommit=True) as raw:
            raw.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = 'gadget-engine' AND pid <> pg_backend_pid()"
            )
        assert [j.id for j in await a.list_jobs()] == ["j"]  # a read connects again at once
        with psycopg.connect(pg_url, autocommit=True) as raw:
            raw.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = 'gadget-engine' AND pid <> pg_backend_pid()"
            )
        with pytest.raises(StoreError):  # a write's outcome is the caller's to retry (RetryPolicy)
            await a.claim_due(NOW, acked=True)
        assert len((await a.claim_due(NOW, acked=True)).claims) == 1  # the next attempt connects again


def test_pg_password_never_shown(tmp_path: Any) -> None:
    url = "postgresql://fleet:s3cret-pw@127.0.0.1:1/jobs"
    store = PostgresJobStore(url, "a")
    assert "s3cret" not in store.describe() and "s3cret" not in repr(store)
    config = EngineConfig(state_dir=str(tmp_path), store_url=url)
    assert "s3cret" not in repr(config) and "***" in repr(config)
    with pytest.raises(ValueError, match=r"\*\*\*") as bad:
        EngineConfig(store_url="mysql://fleet:s3cret-pw@host/db")
    assert "s3cret" not in str(bad.value)

    async def opening() -> None:
        await store.open()

    with pytest.raises(StoreError) as failed:
        trio.run(opening)
    assert "s3cret" not in str(failed.value) and "cannot connect" in str(failed.value)


async def test_pg_exit_notices_are_kept_per_engine_and_recorded_once(pg_url: str) -> None:
    async with stores(pg_url, "a", "b") as (a, b):
        fire = text_fire("subprocess 4242", "it exited")
        await a.add_notice("subprocess:4242", "1f2e3d4c5b6a7988", fire)
        assert await a.pending_notices() == [fire.fire_id]
        assert await b.pending_notices() == []  # another engine's notice is not its to record
        event = await a.record_notice(fire.fire_id, acked=True)
        assert event is not None and (event.job_id, event.project) == ("subprocess:4242", "1f2e3d4c5b6a7988")
        assert await a.record_notice(fire.fire_id, acked=True) is None
        assert [e.fire_id for e in await b.events()] == [fire.fire_id]
