"""The store's numbered schema steps (``engine/cron/_migrations.py``) on real SQLite files."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import attrs
import pytest

from engine import SqliteJobStore, StoreError
from engine.cron._events import text_fire
from engine.cron._migrations import MIGRATIONS, SCHEMA_VERSION, migrate

from .test_cron_store import exited, job


def _connect(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


def _version(path: Path) -> int:
    conn = _connect(path)
    try:
        version: int = conn.execute("PRAGMA user_version").fetchone()[0]
        return version
    finally:
        conn.close()


def test_migrations_are_numbered_steps() -> None:
    assert SCHEMA_VERSION == len(MIGRATIONS) == 4
    assert all(
        step.__doc__ and step.__doc__.startswith(f"{n} -> {n + 1}:") for n, step in enumerate(MIGRATIONS)
    )


async def test_migrations_take_a_file_of_every_older_version_to_the_newest(tmp_path: Path) -> None:
    for old in range(SCHEMA_VERSION):
        path = tmp_path / f"v{old}.sqlite3"
        conn = _connect(path)
        migrate(conn, str(path), MIGRATIONS[:old])  # a file as the engine of version ``old`` left it
        if old >= 1:
            j = job("a")
            conn.execute("INSERT INTO jobs (id, data) VALUES (?, ?)", (j.id, json.dumps(j.to_dict())))
        conn.close()
        assert _version(path) == old
        store = SqliteJobStore(str(path))
        await store.open()
        try:
            assert [j.id for j in await store.list_jobs()] == (["a"] if old >= 1 else [])
            await store.insert_job(job("b"))
            fire = text_fire("b", "after the upgrade")
            await store.commit_fire("b", exited, fire)
            assert (await store.record_event("b", fire)).fire_id == fire.fire_id
            assert [e.fire_id for e in await store.unacked_events()] == [fire.fire_id]
        finally:
            await store.aclose()
        assert _version(path) == SCHEMA_VERSION


def test_migration_step_that_fails_leaves_the_version_before_it(tmp_path: Path) -> None:
    path = tmp_path / "cron.sqlite3"

    def broken(conn: sqlite3.Connection) -> None:
        """4 -> 5: half done, then it fails."""
        conn.execute("CREATE TABLE half_done (id INTEGER PRIMARY KEY)")
        raise sqlite3.OperationalError("disk I/O error (test)")

    conn = _connect(path)
    try:
        with pytest.raises(sqlite3.OperationalError, match="test"):
            migrate(conn, str(path), (*MIGRATIONS, broken))
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION  # the good steps stay
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert "half_done" not in tables and {"jobs", "events", "notices"} <= tables
        assert not conn.in_transaction
    finally:
        conn.close()


async def test_store_refuses_a_file_newer_than_its_steps(tmp_path: Path) -> None:
    path = tmp_path / "cron.sqlite3"
    conn = _connect(path)
    migrate(conn, str(path))
    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    conn.close()
    store = SqliteJobStore(str(path))
    with pytest.raises(StoreError, match=f"schema {SCHEMA_VERSION + 1}, newer than this engine's"):
        await store.open()
    assert _version(path) == SCHEMA_VERSION + 1  # refused, not touched


async def test_migration_3_adds_the_project_of_jobs_and_events(tmp_path: Path) -> None:
    path = tmp_path / "cron.sqlite3"
    conn = _connect(path)
    migrate(conn, str(path), MIGRATIONS[:2])  # a version-2 file: no project anywhere
    old = job("old")
    conn.execute("INSERT INTO jobs (id, data) VALUES (?, ?)", (old.id, json.dumps(old.to_dict())))
    conn.close()
    store = SqliteJobStore(str(path))
    await store.open()
    try:
        assert (await store.get_job("old")).project is None
        fire = text_fire("old", "from before")
        await store.commit_fire("old", exited, fire)
        assert (await store.deliver_fire("old", fire)).project is None
        mine = attrs.evolve(job("mine"), project="1f2e3d4c5b6a7988")
        await store.insert_job(mine)
        assert (await store.get_job("mine")).project == "1f2e3d4c5b6a7988"
        fire = text_fire("mine", "scoped")
        await store.commit_fire("mine", exited, fire)
        await store.deliver_fire("mine", fire)
        assert [(e.job_id, e.project) for e in await store.events()] == [
            ("old", None),
            ("mine", "1f2e3d4c5b6a7988"),
        ]
        with pytest.raises(ValueError, match="keep the job's id and project"):
            await store.update_job("mine", lambda j: attrs.evolve(j, project=None))
        _, event = await store.delete_job("mine")
        assert event is None
    finally:
        await store.aclose()
    conn = _connect(path)
    try:
        rows = conn.execute("SELECT id, project FROM jobs ORDER BY seq").fetchall()
        assert rows == [("old", None)]
        assert _version(path) == SCHEMA_VERSION
    finally:
        conn.close()


async def test_migration_4_adds_the_notices_and_a_notice_is_recorded_once(tmp_path: Path) -> None:
    path = tmp_path / "cron.sqlite3"
    conn = _connect(path)
    migrate(conn, str(path), MIGRATIONS[:3])  # a version-3 file: no notices table
    conn.close()
    store = SqliteJobStore(str(path))
    await store.open()
    try:
        fire = text_fire("subprocess 4242", "it exited")
        await store.add_notice("subprocess:4242", "1f2e3d4c5b6a7988", fire)
        assert await store.pending_notices() == [fire.fire_id]
        event = await store.record_notice(fire.fire_id, acked=False)
        assert event is not None
        assert (event.job_id, event.project, event.fire_id) == (
            "subprocess:4242",
            "1f2e3d4c5b6a7988",
            fire.fire_id,
        )
        assert await store.pending_notices() == []
        assert await store.record_notice(fire.fire_id, acked=False) is None  # recorded once
        assert [e.fire_id for e in await store.unacked_events()] == [fire.fire_id]
    finally:
        await store.aclose()
    assert _version(path) == 4
