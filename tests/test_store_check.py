"""A damaged job store is reported, not silently shrunk; poison text in a row is shown escaped
(``engine/cron/_store_check.py``, ``engine/cron/_rows.py``): issue 16."""

from __future__ import annotations

import glob
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from engine import At, EngineConfig, Every, StoreError, SystemEvent, open_engine
from engine.cron._store import SqliteJobStore
from engine.cron._store_check import DamagedStoreError, wal_problem

from .serve_support import cli, start_serve

FAR = "2099-01-01T00:00:00+00:00"


def config(state: Path, **settings: object) -> EngineConfig:
    return EngineConfig(
        state_dir=str(state),
        grace_seconds=0.3,
        kill_wait_seconds=2.0,
        guardian=False,
        exit_watch_shell=("bash", "-c", "--"),
        **settings,  # type: ignore[arg-type]  # EngineConfig checks them
    )


async def add_jobs(state: Path, count: int, *, name_bytes: int = 400) -> list[str]:
    from datetime import datetime

    async with open_engine(config(state)) as engine:
        ids = []
        for i in range(count):
            job = await engine.cron.add(
                At(datetime.fromisoformat(FAR)), SystemEvent(f"job {i}"), name=f"{i:04d}-" + "n" * name_bytes
            )
            ids.append(job.id)
        return ids


#: Adds jobs one transaction each, then dies without closing: the write-ahead log keeps every frame.
_CRASH_AFTER_WRITES = """
import os, sys, trio
from datetime import datetime, UTC
from engine.cron._store import SqliteJobStore
from engine.cron._job import CronJob, SystemEvent
from engine.cron._schedule import At

async def main():
    store = SqliteJobStore(sys.argv[1])
    await store.open()
    now = datetime.now(UTC)
    far = At(datetime(2099, 1, 1, tzinfo=UTC))
    for i in range(int(sys.argv[2])):
        job = CronJob(id=f"job{i:03d}", name="w" * 300, enabled=True, schedule=far,
            payload=SystemEvent(f"t{i}"), delete_after_run=False, created_at=now, updated_at=now)
        await store.insert_job(job)
    os._exit(0)

trio.run(main)
"""


def crash_after_writes(path: Path, count: int) -> None:
    subprocess.run([sys.executable, "-c", _CRASH_AFTER_WRITES, str(path), str(count)], check=True, timeout=60)
    assert os.path.getsize(f"{path}-wal") > 0


def frame_offset(wal: Path, index: int) -> int:
    """Where frame ``index`` (from 1) of a write-ahead log starts."""
    page_size = int.from_bytes(wal.read_bytes()[8:12], "big")
    return 32 + (index - 1) * (24 + page_size)


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# ---- the write-ahead log -----------------------------------------------------------------------------


def test_wal_with_a_torn_tail_is_not_damage_but_a_bad_frame_before_a_commit_is(tmp_path: Path) -> None:
    db = tmp_path / "cron.sqlite3"
    crash_after_writes(db, 12)
    wal = Path(f"{db}-wal")
    assert wal_problem(str(wal)) is None
    pristine = wal.read_bytes()
    wal.write_bytes(pristine[: frame_offset(wal, 5) + 700])  # a crash mid-frame: the tail is torn
    assert wal_problem(str(wal)) is None
    wal.write_bytes(pristine)
    flip(wal, frame_offset(wal, 3) + 24 + 100)  # a bit rot in frame 3's page; commits follow
    problem = wal_problem(str(wal))
    assert problem is not None and "frame 3" in problem and "would be dropped" in problem
    wal.write_bytes(pristine)
    flip(wal, 20)  # the header's salt: SQLite would ignore the whole log
    assert "header" in (wal_problem(str(wal)) or "")


async def test_wal_damaged_store_stops_the_start_and_repair_keeps_the_readable_prefix(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    db = state / "cron.sqlite3"
    crash_after_writes(db, 12)
    wal = Path(f"{db}-wal")
    flip(wal, frame_offset(wal, 30) + 24 + 100)
    damaged = wal.read_bytes()
    with pytest.raises(DamagedStoreError, match=r"cron\.sqlite3 is damaged \(frame 30 .*--repair"):
        async with open_engine(config(state)):
            pass
    assert wal.read_bytes() == damaged  # nothing changed: no checkpoint dropped the tail
    async with open_engine(config(state, repair_store=True)) as engine:
        kept = [job.id for job in await engine.cron.list()]
    assert 0 < len(kept) < 12 and kept == [f"job{i:03d}" for i in range(len(kept))]
    asides = glob.glob(f"{db}.damaged-*")
    assert sorted(os.path.basename(a).rsplit("-", 1)[-1] for a in asides)[-1] == "wal" and len(asides) == 2
    assert Path(next(a for a in asides if a.endswith("-wal"))).read_bytes() == damaged


# ---- a truncated file, unreadable rows -------------------------------------------------------------


async def test_truncated_store_is_a_start_up_error_and_serve_repair_keeps_the_rest(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    ids = await add_jobs(state, 60)
    db = state / "cron.sqlite3"
    assert not os.path.exists(f"{db}-wal")  # closed cleanly: everything is in the file
    size = db.stat().st_size
    os.truncate(db, size // 2)
    with pytest.raises(DamagedStoreError, match=r"is damaged .*nothing was changed.*serve --repair"):
        async with open_engine(config(state)):
            pass
    assert db.stat().st_size == size // 2
    result = await trio.to_thread.run_sync(lambda: cli("--state-dir", str(state), "serve", timeout=30))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("gadget-engine: the engine could not start: the job store ") and "--repair" in last
    served = await trio.to_thread.run_sync(lambda: start_serve(state, "--repair"))
    try:
        listed = await trio.to_thread.run_sync(lambda: served.cli("cron", "list", "--json"))
        kept = [json.loads(line)["id"] for line in listed.stdout.splitlines()]
        assert set(kept) <= set(ids) and len(kept) < len(ids)
        assert "repaired: kept" in served.log() and "Traceback" not in served.log()
    finally:
        assert served.stop() == 0
    assert len(glob.glob(f"{db}.damaged-*")) == 1
    async with open_engine(config(state)) as engine:  # the repaired store opens as it is
        assert [job.id for job in await engine.cron.list()] == kept


async def test_unreadable_row_stops_the_start_naming_it_and_repair_drops_only_it(tmp_path: Path) -> None:
    state = tmp_path / "state"
    ids = await add_jobs(state, 3, name_bytes=10)
    db = state / "cron.sqlite3"
    conn = sqlite3.connect(db)
    conn.execute("INSERT INTO jobs (id, data) VALUES ('junk', 'not json at all')")
    conn.execute("UPDATE jobs SET watch_state = '[1]' WHERE id = ?", (ids[1],))
    conn.commit()
    conn.close()
    with pytest.raises(
        StoreError, match=r"2 rows cannot be read: .*watch state of job .*record of job 'junk'"
    ):
        async with open_engine(config(state)):
            pass
    async with open_engine(config(state, repair_store=True)) as engine:
        assert [job.id for job in await engine.cron.list()] == ids  # the job with a bad watch state stays
    aside = glob.glob(f"{db}.damaged-*")
    assert len(aside) == 1
    old = sqlite3.connect(aside[0])  # the damaged file opens for a manual recovery
    assert old.execute("SELECT data FROM jobs WHERE id = 'junk'").fetchone() == ("not json at all",)
    old.close()


async def test_store_that_is_not_a_database_is_damage_not_a_traceback(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "cron.sqlite3").write_bytes(b"this is no database at all, just text" * 100)
    with pytest.raises(DamagedStoreError, match="file is not a database"):
        async with open_engine(config(state)):
            pass
    async with open_engine(config(state, repair_store=True)) as engine:
        assert await engine.cron.list() == []
    assert len(glob.glob(str(state / "cron.sqlite3.damaged-*"))) == 1


# ---- poison values already in a record --------------------------------------------------------------


def poison(db: Path, job_id: str) -> None:
    """Put a lone surrogate in the job's text (as an older engine could) and bytes that are not UTF-8 in
    its name, as a file planted in the store could."""
    conn = sqlite3.connect(db)
    data = json.loads(conn.execute("SELECT data FROM jobs WHERE id = ?", (job_id,)).fetchone()[0])
    data["payload"]["text"] = "caf\udce9 ready"
    text = json.dumps(data).replace('"name": "NAME"', '"name": "bad-\\u0000-name"')
    conn.execute("UPDATE jobs SET data = ? WHERE id = ?", (text, job_id))
    raw = json.dumps({**data, "id": "raw", "name": "RAWNAME"}).encode().replace(b"RAWNAME", b"caf\xe9")
    conn.execute("INSERT INTO jobs (id, data) VALUES ('raw', CAST(? AS TEXT))", (raw,))
    conn.commit()
    conn.close()


async def test_record_holding_poison_text_never_stops_start_list_or_a_fire(tmp_path: Path) -> None:
    """Tried: a job whose text held ``"\\udcff"`` was stored; once it fired, its event could not be
    written, ``cron.remove`` failed and every later ``serve`` on the state dir exited 2."""
    state = tmp_path / "state"
    async with open_engine(config(state)) as engine:
        job = await engine.cron.add(Every(1.0), SystemEvent("POISON"), name="NAME", enabled=False)
    poison(state / "cron.sqlite3", job.id)
    served = await trio.to_thread.run_sync(lambda: start_serve(state))
    try:
        table = await trio.to_thread.run_sync(lambda: served.cli("cron", "list"))
        assert table.returncode == 0, table.stderr
        assert "bad-\\x00-name" in table.stdout and "caf\\xe9" in table.stdout.replace("\\udce9", "\\xe9")
        as_json = await trio.to_thread.run_sync(lambda: served.cli("cron", "list", "--json"))
        texts = [json.loads(line)["payload"]["text"] for line in as_json.stdout.splitlines()]
        assert texts == ["caf\\udce9 ready", "caf\\udce9 ready"]
        enabled = await trio.to_thread.run_sync(lambda: served.cli("cron", "enable", job.id))
        assert enabled.returncode == 0, enabled.stderr
        with trio.fail_after(10):
            while True:
                events = await trio.to_thread.run_sync(lambda: served.cli("events", "--json"))
                if events.stdout.strip():
                    break
                await trio.sleep(0.2)
        assert json.loads(events.stdout.splitlines()[0])["text"] == "caf\\udce9 ready"
        for job_id in (job.id, "raw"):
            removed = await trio.to_thread.run_sync(served.cli, "cron", "rm", job_id)
            assert removed.returncode == 0, removed.stderr
    finally:
        assert served.stop() == 0
    assert "Traceback" not in served.log()
    again = await trio.to_thread.run_sync(lambda: start_serve(state))  # and it starts again
    assert again.stop() == 0


async def test_event_row_with_bytes_that_are_not_utf8_is_listed_escaped(tmp_path: Path) -> None:
    store = SqliteJobStore(str(tmp_path / "cron.sqlite3"))
    await store.open()
    await store.aclose()
    conn = sqlite3.connect(tmp_path / "cron.sqlite3")
    conn.execute(
        "INSERT INTO events (fire_id, job_id, job_name, text, stdout_tail, stderr_tail, truncated) "
        "VALUES ('f1', 'j1', 'n', CAST(? AS TEXT), '', '', 0)",
        (b"out \xff\xfe",),
    )
    conn.commit()
    conn.close()
    await store.open()
    try:
        (event,) = await store.events()
        assert event.text == "out \\udcff\\udcfe"
    finally:
        await store.aclose()
