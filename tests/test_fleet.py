"""A fleet: several ``gadget-engine serve`` processes, each on its own state dir, on one PostgreSQL store.

Each due time of a floating job fires exactly once in total whatever engine is SIGKILLed around it;
``Command`` and on-exit jobs run only on the engine that added them; ``events --follow`` on one engine
prints the events of the others; ``fleet`` lists every engine with the age of its heartbeat.
"""

from __future__ import annotations

import json
import random
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest
import trio

from engine import At, CronJob, SystemEvent
from engine.cron._pg_store import PostgresJobStore

from .serve_support import Served, start_serve, wait_until

#: SIGKILL rounds: a few in the normal suite, more under ``-m slow``.
ROUNDS = 5
SLOW_ROUNDS = 20
#: Jobs due together in each round, and over how many seconds their due times spread.
JOBS = 300
SPREAD_SECONDS = 2.0
#: The engines' owner_lost_seconds here: over one heartbeat period (5 s), under the default 60 s.
OWNER_LOST_SECONDS = 8


def _serve(state_dir: Path, url: str, engine_id: str) -> Served:
    return start_serve(
        state_dir, "--store", url, "--engine-id", engine_id, "--owner-lost-seconds", str(OWNER_LOST_SECONDS)
    )


@pytest.fixture
def fleet(tmp_path: Path, pg_url: str) -> Iterator[dict[str, Served]]:
    engines = {name: _serve(tmp_path / name, pg_url, name) for name in ("a", "b", "c")}
    try:
        yield engines
    finally:
        for engine in engines.values():
            engine.stop()


def _at(seconds: float) -> str:
    return (datetime.now(UTC) + timedelta(seconds=seconds)).isoformat()


def _fired(url: str, jobs: list[str]) -> list[tuple[str, str, str]]:
    """(job id, fire id, engine id) of every logged event of ``jobs``."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT job_id, fire_id, engine_id FROM gadget_events WHERE job_id = ANY(%s)", (jobs,)
        ).fetchall()
    return [(str(a), str(b), str(c)) for a, b, c in rows]


async def _add_due_jobs(url: str, round_no: int, due_in: float) -> list[str]:
    """Add :data:`JOBS` one-shot text jobs due within :data:`SPREAD_SECONDS` after ``due_in`` seconds,
    straight into the shared store (one transaction each, as an engine's ``cron add`` writes them)."""
    store = PostgresJobStore(url, "tester")
    await store.open()
    now = datetime.now(UTC)
    ids = []
    try:
        for i in range(JOBS):
            at = now + timedelta(seconds=due_in + SPREAD_SECONDS * i / JOBS)
            job = CronJob(
                id=f"r{round_no}-{i}-{secrets.token_hex(3)}",
                name=f"round {round_no} job {i}",
                enabled=True,
                schedule=At(at),
                payload=SystemEvent(f"round {round_no} job {i}"),
                delete_after_run=True,
                created_at=now,
                updated_at=now,
                next_run_at=at,
                owner="tester",
            )
            await store.insert_job(job)
            ids.append(job.id)
    finally:
        await store.aclose()
    return ids


def _rounds(fleet: dict[str, Served], url: str, rounds: int) -> None:
    rng = random.Random(20)
    names = sorted(fleet)
    for n in range(rounds):
        due_in = 3.0
        jobs = trio.run(_add_due_jobs, url, n, due_in)
        added_at = time.monotonic()
        victim = rng.choice(names)
        # Before the claims, inside them, right after them: anywhere around the due times.
        kill_at = added_at + rng.uniform(due_in - 2.5, due_in + SPREAD_SECONDS + 0.5)
        time.sleep(max(0.0, kill_at - time.monotonic()))
        fleet[victim].kill_hard()
        assert wait_until(lambda jobs=jobs: len(_fired(url, jobs)) >= JOBS, 30.0), (
            f"round {n}: {len(_fired(url, jobs))} of {JOBS} fired after {victim} was killed"
        )
        fleet[victim] = _serve(fleet[victim].state_dir, url, victim)  # restarted: nothing twice
        time.sleep(0.5)
        fired = _fired(url, jobs)
        assert len(fired) == JOBS and sorted(j for j, _, _ in fired) == sorted(jobs), f"round {n}"
        assert len({f for _, f, _ in fired}) == JOBS


def test_fleet_each_due_time_fires_once_while_engines_are_killed(
    fleet: dict[str, Served], pg_url: str
) -> None:
    _rounds(fleet, pg_url, ROUNDS)
    with psycopg.connect(pg_url) as conn:
        engines = {row[0] for row in conn.execute("SELECT DISTINCT engine_id FROM gadget_events")}
    assert engines <= {"a", "b", "c"} and len(engines) >= 2  # fired by whichever engine claimed first


@pytest.mark.slow
def test_fleet_each_due_time_fires_once_through_many_kills(fleet: dict[str, Served], pg_url: str) -> None:
    _rounds(fleet, pg_url, SLOW_ROUNDS)


def test_fleet_command_and_on_exit_jobs_run_only_on_their_owner(
    fleet: dict[str, Served], pg_url: str, tmp_path: Path
) -> None:
    a, b = fleet["a"], fleet["b"]
    command = a.cli("cron", "add", "--every", "1", "--command", "sh", "-c", "echo ran").stdout.strip()
    watched = a.cli("cron", "add", "--on-exit", "sleep 1; echo done", "--cwd", str(tmp_path), "--text", "x")
    watched_id = watched.stdout.strip()
    assert wait_until(lambda: len(_fired(pg_url, [command])) >= 3, 15.0)
    assert wait_until(lambda: len(_fired(pg_url, [watched_id])) == 1, 15.0)
    assert {e for _, _, e in _fired(pg_url, [command, watched_id])} == {"a"}
    with b.client() as client:
        assert client.call("status")["watched"] == 0
        jobs = {job["id"]: job for job in client.call("cron.list")}
    assert jobs[command]["owner"] == "a" and "owner_lost" not in jobs[command]
    assert (tmp_path / "a" / "cron-logs" / f"{command}.stdout.log").exists()
    assert not (tmp_path / "b" / "cron-logs").exists() or not list((tmp_path / "b" / "cron-logs").iterdir())
    with b.client() as client, pytest.raises(Exception, match="runs only on engine 'a'"):
        client.call("cron.run_now", job_id=command)  # run_now elsewhere is refused: only a runs it
    a.kill_hard()  # a is gone: after owner_lost_seconds its jobs show "owner lost" on b
    assert wait_until(lambda: "owner lost" in b.cli("cron", "list").stdout, OWNER_LOST_SECONDS + 10.0)
    listed = b.cli("cron", "list").stdout
    assert "a (owner lost)" in listed and "OWNER" in listed
    before = len(_fired(pg_url, [command]))
    time.sleep(2.5)
    assert len(_fired(pg_url, [command])) == before  # nothing of a's runs elsewhere


def test_fleet_events_follow_on_one_engine_prints_the_others(fleet: dict[str, Served], pg_url: str) -> None:
    c = fleet["c"]
    argv = [sys.executable, "-m", "engine", "--state-dir", str(c.state_dir), "events", "-f", "--json"]
    follower = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)  # following
        began = time.monotonic()
        for name in ("a", "b"):
            fleet[name].cli("cron", "add", "--at", "+1s", "--text", f"from {name}")
        seen: set[str] = set()
        assert follower.stdout is not None
        while seen != {"from a", "from b"}:
            line = follower.stdout.readline()
            assert line, follower.stderr.read() if follower.stderr else ""
            seen.add(json.loads(line)["text"])
        assert time.monotonic() - began < 1.0 + 5.0  # due in 1 s, printed within the 5 s bound
    finally:
        follower.terminate()
        follower.communicate(timeout=10)


def test_fleet_lists_every_engine_with_its_heartbeat(fleet: dict[str, Served]) -> None:
    out = fleet["b"].cli("fleet", "--json")
    assert out.returncode == 0, out.stderr
    members = [json.loads(line) for line in out.stdout.splitlines()]
    assert sorted(m["engine_id"] for m in members) == ["a", "b", "c"]
    assert [m["engine_id"] for m in members if m["self"]] == ["b"]
    assert all(m["age_seconds"] < 10 and not m["lost"] and m["pid"] > 0 for m in members)
    table = fleet["b"].cli("fleet").stdout
    assert table.splitlines()[0].split() == [
        "ENGINE", "HOST", "PID", "VERSION", "CONTAINMENT", "RUNS", "HEARTBEAT", "STATE",
    ]  # fmt: skip
    assert "b *" in table
    status = fleet["a"].cli("status").stdout
    assert "postgresql://" in status
