"""The cron service (``engine/cron/_service.py``): timer, run pipeline, event log, restarts, bad input."""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterable
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from engine import (
    At,
    Command,
    Cron,
    CronJob,
    EngineConfig,
    Every,
    FiredEvent,
    InvalidArgumentError,
    InvalidScheduleError,
    JobNotFoundError,
    JobStatus,
    OnExit,
    SqliteJobStore,
    StoreError,
    Supervisor,
    SystemEvent,
    open_engine,
)
from engine.cron import CronService, open_cron_service
from engine.cron._claims import CLAIM_BATCH, DueClaims
from engine.cron._events import text_fire

from .children import SESSION, mark, pgrep, wait_until
from .test_cron_store import FullDiskConnection, exited
from .watch_support import end_left_commands

T0 = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
REPO = Path(__file__).resolve().parent.parent


class WallClock:
    """Wall time that follows the Trio clock from ``start``, and can be stepped (downtime, NTP)."""

    def __init__(self, start: datetime = T0) -> None:
        self.start = start
        self.origin = trio.current_time()
        self.offset = 0.0

    def __call__(self) -> datetime:
        return self.start + timedelta(seconds=trio.current_time() - self.origin + self.offset)

    def step(self, seconds: float) -> None:
        self.offset += seconds


class CountingStore(SqliteJobStore):
    """The real store, counting how often the timer reads the job list (or looks for due jobs)."""

    reads = 0

    async def list_jobs(self) -> list[CronJob]:
        self.reads += 1
        return await super().list_jobs()

    async def claim_due(
        self, now: datetime, *, skip: Collection[str] = (), acked: bool, limit: int = CLAIM_BATCH
    ) -> DueClaims:
        self.reads += 1
        return await super().claim_due(now, skip=skip, acked=acked, limit=limit)


@pytest.fixture
def clock(store_clock: trio.testing.MockClock) -> trio.testing.MockClock:
    # Jump only while no store call runs in a worker thread (conftest's store_clock).
    return store_clock


@asynccontextmanager
async def cron_service(
    state_dir: Path,
    supervisor: Supervisor,
    wall: Callable[[], datetime],
    *,
    store: SqliteJobStore | None = None,
    on_fire: Callable[[FiredEvent], Any] | None = None,
    on_jobs_changed: Callable[[list[CronJob]], Any] | None = None,
) -> AsyncIterator[CronService]:
    async with open_cron_service(
        state_dir=str(state_dir),
        supervisor=supervisor,
        store=store,
        now=wall,
        on_fire=on_fire,
        on_jobs_changed=on_jobs_changed,
    ) as service:
        yield service


async def test_the_clock_stands_still_while_a_store_call_runs_in_a_thread(
    clock: trio.testing.MockClock,
) -> None:
    # Found on a new VM: a COMMIT waiting 76-391 ms for fsync let the clock jump to the test's deadline.
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.sleep, 1000)  # a deadline the clock would jump to
        start = trio.current_time()
        await trio.to_thread.run_sync(time.sleep, 0.3)  # a slow store call
        assert trio.current_time() - start < 1
        nursery.cancel_scope.cancel()


async def test_service_every_fires_each_due_time_once(
    clock: trio.testing.MockClock, tmp_path: Path, supervisor: Supervisor
) -> None:
    wall = WallClock()
    async with cron_service(tmp_path, supervisor, wall) as cron:
        job = await cron.add(Every(60, anchor=T0), SystemEvent("tick"), name="ticker")
        assert job.next_run_at == T0 + timedelta(seconds=60)
        await trio.sleep(185)
        events = await cron.events()
        assert [e.cursor for e in events] == [1, 2, 3]
        assert {e.text for e in events} == {"tick"} and {e.job_name for e in events} == {"ticker"}
        assert len({e.fire_id for e in events}) == 3
        job = await cron.get(job.id)
        assert job.last_run_at == T0 + timedelta(seconds=180)
        assert job.next_run_at == T0 + timedelta(seconds=240)
        assert job.last_status is JobStatus.OK
        assert await cron.events(since=2) == events[2:]


async def test_service_cr06_hourly_new_york_job_fires_25_times_on_fall_back_day(
    clock: trio.testing.MockClock, tmp_path: Path, supervisor: Supervisor
) -> None:
    """CR-06 row 4 through the timer: real time, 3600 s apart, across the repeated hour."""
    wall = WallClock(datetime(2026, 11, 1, 3, 59, 30, tzinfo=UTC))
    fired_at: list[datetime] = []

    async def on_fire(event: FiredEvent) -> None:
        fired_at.append(wall())

    async with cron_service(tmp_path, supervisor, wall, on_fire=on_fire) as cron:
        cron.recheck_seconds = 3600.0  # the wall clock is not stepped here: wake at due times only
        await cron.add(Cron("0 * * * *", "America/New_York"), SystemEvent("hourly"))
        await trio.sleep(24 * 3600 + 60)
        assert len(await cron.events()) == 25
    due = [moment.replace(second=0, microsecond=0) for moment in fired_at]
    assert due[0] == datetime(2026, 11, 1, 4, 0, tzinfo=UTC) and due[-1] == datetime(
        2026, 11, 2, 4, tzinfo=UTC
    )
    assert {b - a for a, b in itertools.pairwise(due)} == {timedelta(hours=1)}


async def test_service_idle_timer_does_not_busy_loop(
    clock: trio.testing.MockClock, tmp_path: Path, supervisor: Supervisor
) -> None:
    store = CountingStore(str(tmp_path / "cron.sqlite3"))
    async with cron_service(tmp_path, supervisor, WallClock(), store=store) as cron:
        await trio.sleep(3600)
        assert store.reads <= 3  # no timed job: it sleeps until a change
        await cron.add(Every(86400), SystemEvent("daily"))
        before = store.reads
        await trio.sleep(3600)
        assert 55 <= store.reads - before <= 65  # a look at the wall clock about once a minute


async def test_service_missed_job_after_downtime_runs_once(
    clock: trio.testing.MockClock, tmp_path: Path, supervisor: Supervisor
) -> None:
    wall = WallClock()
    async with cron_service(tmp_path, supervisor, wall) as cron:
        job = await cron.add(Every(60, anchor=T0), SystemEvent("tick"))
    wall.step(5 * 3600)  # the engine is down for five hours: 300 slots missed
    async with cron_service(tmp_path, supervisor, wall) as cron:
        await trio.sleep(1)
        assert len(await cron.events()) == 1
        after = await cron.get(job.id)
        assert after.next_run_at == T0 + timedelta(hours=5, seconds=60)
        await trio.sleep(60)
        assert len(await cron.events()) == 2


async def test_service_at_never_runs_again_after_restart(
    clock: trio.testing.MockClock, tmp_path: Path, supervisor: Supervisor
) -> None:
    wall = WallClock()
    async with cron_service(tmp_path, supervisor, wall) as cron:
        once = await cron.add(At(T0 + timedelta(seconds=10)), SystemEvent("once"))
        gone = await cron.add(At(T0 + timedelta(seconds=10)), SystemEvent("gone"), delete_after_run=True)
        await trio.sleep(20)
        assert sorted(e.text for e in await cron.events()) == ["gone", "once"]
        job = await cron.get(once.id)
        assert not job.enabled and job.next_run_at is None and job.last_status is JobStatus.OK
        with pytest.raises(JobNotFoundError):
            await cron.get(gone.id)
    wall.step(-60)  # even with the clock back before its time, a spent one-shot stays spent
    async with cron_service(tmp_path, supervisor, wall) as cron:
        await trio.sleep(120)
        assert len(await cron.events()) == 2


async def test_service_wall_clock_stepped_back_never_reruns_a_due_time(
    clock: trio.testing.MockClock, tmp_path: Path, supervisor: Supervisor
) -> None:
    wall = WallClock()
    async with cron_service(tmp_path, supervisor, wall) as cron:
        await cron.add(Every(60, anchor=T0), SystemEvent("tick"))
        await trio.sleep(70)
        assert len(await cron.events()) == 1
        wall.step(-120)  # back to T0 - 50 s: the 60 s slot comes round on the wall clock again
        await trio.sleep(150)  # wall: T0 + 100 s
        assert len(await cron.events()) == 1
        await trio.sleep(30)  # wall: T0 + 130 s, past the 120 s slot
        assert len(await cron.events()) == 2


async def test_service_bad_input_raises_typed_errors_and_writes_nothing(
    clock: trio.testing.MockClock, tmp_path: Path, supervisor: Supervisor
) -> None:
    async with cron_service(tmp_path, supervisor, WallClock()) as cron:
        # The values check their fields when made: each case makes its schedule and payload in the raises.
        cases: list[tuple[Callable[[], Any], Callable[[], Any], str]] = [
            (lambda: At(T0 - timedelta(seconds=1)), lambda: SystemEvent("x"), "at"),
            (lambda: Cron("99 * * * *"), lambda: SystemEvent("x"), "expr"),
            (lambda: Cron("0 9 * * *", "Nowhere/Town"), lambda: SystemEvent("x"), "tz"),
            (lambda: OnExit(""), lambda: SystemEvent("x"), "command"),
            (lambda: Every(-1), lambda: SystemEvent("x"), "every_seconds"),
            (lambda: Every(1e-9), lambda: SystemEvent("x"), "every_seconds"),
            (lambda: Every(0.01), lambda: SystemEvent("x"), "every_seconds"),
            (lambda: Every(1e308), lambda: SystemEvent("x"), "every_seconds"),
            (lambda: Every(float("nan")), lambda: SystemEvent("x"), "every_seconds"),
            (lambda: Every(float("inf")), lambda: SystemEvent("x"), "every_seconds"),
            (
                lambda: OnExit("true", cwd="/nonexistent"),
                lambda: SystemEvent("x"),
                "cwd '/nonexistent' does not exist",
            ),
            (
                lambda: OnExit("true", cwd="relative/dir"),
                lambda: SystemEvent("x"),
                "cwd 'relative/dir' is relative",
            ),
            (lambda: Every(10), lambda: SystemEvent(""), "text"),
            (lambda: Every(10), lambda: Command(()), "argv"),
            (lambda: Every(10), lambda: SystemEvent("\udcff"), "text"),
            (lambda: "daily", lambda: SystemEvent("x"), "schedule"),
        ]
        for schedule, payload, field in cases:
            with pytest.raises(InvalidScheduleError, match=field):
                await cron.add(schedule(), payload())
        assert await cron.list() == []
        with pytest.raises(InvalidArgumentError, match="name"):
            await cron.add(Every(10), SystemEvent("x"), name="caf\udce9")
        with pytest.raises(InvalidArgumentError, match="enabled"):
            await cron.add(Every(10), SystemEvent("x"), enabled=1)  # type: ignore[arg-type]  # on purpose
        assert await cron.list() == []
        job = await cron.add(Every(10), SystemEvent("x"))
        with pytest.raises(InvalidArgumentError, match="colour"):
            await cron.update(job.id, colour="red")
        with pytest.raises(InvalidArgumentError, match="name"):
            await cron.update(job.id, name="")
        with pytest.raises(InvalidScheduleError, match="tz"):
            await cron.update(job.id, schedule=Cron("0 9 * * *", "Atlantis/Main"))
        with pytest.raises(InvalidScheduleError, match="at"):
            await cron.update(job.id, schedule=At(T0 - timedelta(days=1)))
        with pytest.raises(InvalidScheduleError, match="every_seconds"):
            await cron.update(job.id, schedule=Every(1e-9))
        with pytest.raises(InvalidScheduleError, match="cwd"):
            await cron.update(job.id, schedule=OnExit("true", cwd=str(tmp_path / "missing")))
        assert await cron.list() == [job]
        for call in (cron.get, cron.remove, cron.enable, cron.disable, cron.run_now):
            with pytest.raises(JobNotFoundError, match="nope"):
                await call("nope")
            with pytest.raises(InvalidArgumentError, match="job_id holds the lone surrogate"):
                await call("\udcff")  # was a UnicodeEncodeError from SQLite
        with pytest.raises(InvalidArgumentError, match="since"):
            await cron.events(since=-1)


async def test_service_update_enable_disable(
    clock: trio.testing.MockClock, tmp_path: Path, supervisor: Supervisor
) -> None:
    wall = WallClock()
    async with cron_service(tmp_path, supervisor, wall) as cron:
        job = await cron.add(Every(60, anchor=T0), SystemEvent("x"), enabled=False)
        assert job.next_run_at is None
        await trio.sleep(100)
        assert await cron.events() == []
        enabled = await cron.enable(job.id)
        assert enabled.enabled and enabled.next_run_at == T0 + timedelta(seconds=120)
        assert [j.id for j in await cron.list(include_disabled=False)] == [job.id]
        renamed = await cron.update(job.id, name="renamed", payload=SystemEvent("y"))
        assert renamed.next_run_at == enabled.next_run_at  # no schedule change: same next run
        await trio.sleep(30)
        [event] = await cron.events()
        assert event.text == "y" and event.job_name == "renamed"
        moved = await cron.update(job.id, schedule=Cron("0 13 * * *", "Europe/Berlin"))
        assert moved.next_run_at == datetime(2026, 6, 2, 11, 0, tzinfo=UTC)
        disabled = await cron.disable(job.id)
        assert not disabled.enabled and disabled.next_run_at is None
        assert await cron.list(include_disabled=False) == []
        await cron.remove(job.id)
        assert await cron.list() == []


async def test_service_notifies_job_changes_with_the_complete_set(
    clock: trio.testing.MockClock, tmp_path: Path, supervisor: Supervisor
) -> None:
    seen: list[list[str]] = []

    async def on_jobs_changed(jobs: list[CronJob]) -> None:
        seen.append([f"{j.id}:{'on' if j.enabled else 'off'}" for j in jobs])

    async with cron_service(tmp_path, supervisor, WallClock(), on_jobs_changed=on_jobs_changed) as cron:
        assert seen == [[]]  # once at start-up
        a = await cron.add(OnExit("make test"), SystemEvent("tests done"))
        assert a.next_run_at is None
        b = await cron.add(Every(60), SystemEvent("tick"))
        await cron.disable(a.id)
        await cron.update(b.id, name="b")
        await cron.remove(b.id)
        assert seen == [
            [],
            [f"{a.id}:on"],
            [f"{a.id}:on", f"{b.id}:on"],
            [f"{a.id}:off", f"{b.id}:on"],
            [f"{a.id}:off", f"{b.id}:on"],
            [f"{a.id}:off"],
        ]


async def test_service_store_failure_raises_and_the_timer_recovers(
    clock: trio.testing.MockClock, tmp_path: Path, supervisor: Supervisor
) -> None:
    store = SqliteJobStore(str(tmp_path / "cron.sqlite3"), connection_factory=FullDiskConnection)
    async with cron_service(tmp_path, supervisor, WallClock(), store=store) as cron:
        job = await cron.add(Every(3600, anchor=T0 - timedelta(seconds=3540)), SystemEvent("tick"))
        FullDiskConnection.armed = True
        try:
            with pytest.raises(StoreError, match="No space"):
                await cron.add(Every(5), SystemEvent("lost"))
            with pytest.raises(StoreError):
                await cron.update(job.id, name="lost")
            await trio.sleep(600)  # due at 60 s: the claim cannot be written, so it does not fire
            assert await cron.events() == []
        finally:
            FullDiskConnection.armed = False
        assert [j.name for j in await cron.list()] == [job.name]
        await trio.sleep(330)  # the timer retries with back-off (at most 5 min) and fires once
        assert len(await cron.events()) == 1


async def test_service_pending_fire_left_by_crash_is_delivered_at_start(
    clock: trio.testing.MockClock, tmp_path: Path, supervisor: Supervisor
) -> None:
    store = SqliteJobStore.in_state_dir(str(tmp_path))
    await store.open()
    job = CronJob(
        id="w1",
        name="watch",
        enabled=True,
        schedule=OnExit("true"),
        payload=SystemEvent("done"),
        delete_after_run=False,
        created_at=T0,
        updated_at=T0,
    )
    await store.insert_job(job)
    fire = text_fire("watch", "the command exited 0")
    await store.commit_fire("w1", exited, fire)
    await store.aclose()

    delivered: list[FiredEvent] = []

    async def on_fire(event: FiredEvent) -> None:
        delivered.append(event)

    async with cron_service(tmp_path, supervisor, WallClock(), on_fire=on_fire) as cron:
        await trio.sleep(1)
        assert [e.fire_id for e in delivered] == [fire.fire_id]
        assert len(await cron.events()) == 1
        assert not (await cron.get("w1")).enabled
        # the watchers' path: a committed exit, then deliver
        fire2 = text_fire("watch", "second")
        await cron.store.commit_fire("w1", exited, fire2)
        await cron.store.record_event("w1", fire2)  # ... and the engine "crashes" before clearing
    async with cron_service(tmp_path, supervisor, WallClock(), on_fire=on_fire) as cron:
        await trio.sleep(1)
        # at least once when embedded: the same fire id again, never a second log entry
        assert [e.fire_id for e in delivered] == [fire.fire_id, fire2.fire_id]
        assert [e.fire_id for e in await cron.events()] == [fire.fire_id, fire2.fire_id]
        assert await cron.store.pending_fires() == []


async def test_service_on_fire_error_keeps_the_fire_for_next_start(
    clock: trio.testing.MockClock, tmp_path: Path, supervisor: Supervisor
) -> None:
    async def broken(event: FiredEvent) -> None:
        raise RuntimeError("host is down")

    async with cron_service(tmp_path, supervisor, WallClock(), on_fire=broken) as cron:
        await cron.add(At(T0 + timedelta(seconds=5)), SystemEvent("hello"))
        await trio.sleep(10)
        assert await cron.store.pending_fires() == []  # recorded in the log ...
        assert [e.text for e in await cron.store.unacked_events()] == ["hello"]  # ... not delivered
    got: list[FiredEvent] = []

    async def works(event: FiredEvent) -> None:
        got.append(event)

    async with cron_service(tmp_path, supervisor, WallClock(), on_fire=works) as cron:
        await trio.sleep(1)
        assert [e.text for e in got] == ["hello"]
        assert len(await cron.events()) == 1


# -- real processes: real clock -------------------------------------------------------------------


async def test_service_command_payload_reports_exit_and_output(
    tmp_path: Path, supervisor: Supervisor
) -> None:
    async with cron_service(tmp_path, supervisor, lambda: datetime.now(UTC)) as cron:
        argv = ("sh", "-c", "echo out; echo err >&2; exit 3")
        job = await cron.add(Every(3600), Command(argv, cwd=str(tmp_path)), name="build")
        with trio.fail_after(10):
            await cron.run_now(job.id)
        [event] = await cron.events()
        assert event.exit_code == 3 and event.signal is None and event.reason == "exit"
        assert event.stdout_tail == "out\n" and event.stderr_tail == "err\n" and not event.truncated
        assert event.command == "sh -c 'echo out; echo err >&2; exit 3'"
        assert "exited with code 3" in event.text and "out" in event.text
        assert event.duration_seconds is not None and event.duration_seconds < 5
        assert (tmp_path / "cron-logs" / f"{job.id}.stdout.log").read_text() == "out\n"
        after = await cron.get(job.id)
        assert after.last_status is JobStatus.ERROR and after.consecutive_errors == 1
        assert after.next_run_at is not None and after.last_run_at is not None
        assert after.next_run_at >= after.last_run_at + timedelta(seconds=30)  # back-off

        # A program that is not there is refused when the job is added (as create refuses it at once) ...
        not_executable = tmp_path / "not-executable"
        not_executable.write_text("exit 0\n")
        for argv0 in ("/no/such/program", "no-such-program-on-path", str(tmp_path), str(not_executable)):
            with pytest.raises(InvalidScheduleError, match="argv\\[0\\]"):
                await cron.add(Every(3600), Command((argv0,)))
            with pytest.raises(InvalidScheduleError, match="argv\\[0\\]"):
                await cron.update(job.id, payload=Command((argv0,)))
        # ... so is a script whose #! interpreter is missing (found by a new user: it failed at its run),
        bad_interpreter = tmp_path / "bad-interpreter"
        bad_interpreter.write_text("#!/nonexistent/interp\nexit 0\n")
        bad_interpreter.chmod(0o755)
        with pytest.raises(InvalidScheduleError, match="its interpreter '/nonexistent/interp'"):
            await cron.add(Every(3600), Command((str(bad_interpreter),)))
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo, 0o755)  # an executable FIFO: the look at its #! line never blocks
        with trio.fail_after(5):
            await cron.remove((await cron.add(Every(3600), Command((str(fifo),)))).id)
        # ... and one removed after the add makes its run's event say so.
        program = tmp_path / "program"
        program.write_text("#!/bin/sh\nexit 0\n")
        program.chmod(0o755)
        missing = await cron.add(Every(3600), Command((str(program),)))
        program.unlink()
        with trio.fail_after(10):
            await cron.run_now(missing.id)
        last = (await cron.events())[-1]
        assert last.reason == "spawn_failed" and last.exit_code is None
        assert str(program) in last.text
        await cron.remove(job.id)
        assert not (tmp_path / "cron-logs" / f"{job.id}.stdout.log").exists()


async def test_service_keeps_the_project_of_a_job_and_its_events(
    tmp_path: Path, supervisor: Supervisor
) -> None:
    async with cron_service(tmp_path, supervisor, WallClock()) as cron:
        mine = await cron.add(At(T0 + timedelta(hours=1)), SystemEvent("mine"), project="1f2e3d4c5b6a7988")
        loose = await cron.add(At(T0 + timedelta(hours=1)), SystemEvent("loose"))
        assert (mine.project, loose.project) == ("1f2e3d4c5b6a7988", None)
        assert (await cron.get(mine.id)).project == "1f2e3d4c5b6a7988"
        await cron.update(mine.id, name="renamed")  # a change keeps it
        assert (await cron.get(mine.id)).project == "1f2e3d4c5b6a7988"
        await cron.run_now(mine.id)
        await cron.run_now(loose.id)
        assert [(e.job_id, e.project) for e in await cron.events()] == [
            (mine.id, "1f2e3d4c5b6a7988"),
            (loose.id, None),
        ]
        for bad in ("", "a\x00b", 7):
            with pytest.raises(InvalidArgumentError, match="project"):
                await cron.add(Every(60), SystemEvent("x"), project=bad)  # type: ignore[arg-type]
        assert len(await cron.list()) == 2


async def test_engine_reopens_the_store_on_the_same_state_dir(tmp_path: Path) -> None:
    config = EngineConfig(state_dir=str(tmp_path), grace_seconds=0.4, kill_wait_seconds=1.0)
    with trio.fail_after(20):
        async with open_engine(config) as engine:
            a = await engine.cron.add(Cron("30 1 * * *", "America/New_York"), SystemEvent("nightly"))
            # A command that outlives the test's look: `make test` alone fails at once here (no Makefile), and
            # with the compiled shim it could end, fire and disable the job before the second look.
            watched = OnExit(f"sleep {mark('30.9')}; make test", cwd=str(tmp_path))
            b = await engine.cron.add(watched, SystemEvent("tests ended"))
            c = await engine.cron.add(Every(3600), Command(("true",)), enabled=False)
            await engine.cron.run_now(a.id)
            events = await engine.cron.events()
            jobs = await engine.cron.list()
        assert os.path.exists(tmp_path / "cron.sqlite3")
        async with open_engine(config) as engine:
            assert await engine.cron.list() == jobs
            assert [j.id for j in jobs] == [a.id, b.id, c.id]
            assert await engine.cron.events() == events
    end_left_commands(tmp_path)  # `make test` may still run: a graceful stop leaves it to the next engine


async def test_docs_example_runs(tmp_path: Path) -> None:
    with trio.fail_after(30):
        result = await trio.run_process(
            [sys.executable, str(REPO / "docs" / "examples" / "cron_example.py"), str(tmp_path)],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    assert result.returncode == 0, result.stderr.decode()
    out = result.stdout.decode()
    assert "stand up and stretch" in out and "build ok" in out


# -- delivery when embedded: acknowledged per event -----------------------------------------------


async def test_engine_on_fire_failures_are_all_delivered_after_restart(tmp_path: Path) -> None:
    """The tester's scenario: on_fire raises for every fire of an every-second job for ~4.5 s."""
    config = EngineConfig(state_dir=str(tmp_path), grace_seconds=0.4, kill_wait_seconds=1.0)
    failed: list[str] = []

    async def broken(event: FiredEvent) -> None:
        failed.append(event.fire_id)
        raise RuntimeError("host is down")

    with trio.fail_after(20):
        async with open_engine(config, on_fire=broken) as engine:
            await engine.cron.add(Every(every_seconds=1), SystemEvent("ev"))
            await trio.sleep(4.5)
        logged = [e.fire_id for e in await _events_of(tmp_path)]
        assert len(logged) >= 4 and set(logged) <= set(failed)
        got: list[str] = []

        async def works(event: FiredEvent) -> None:
            got.append(event.fire_id)

        async with open_engine(config, on_fire=works) as engine:
            while len(got) < len(logged):
                await trio.sleep(0.05)
            events = await engine.cron.events()
    assert got[: len(logged)] == logged  # every fire of the first run, in cursor order, first
    fire_ids = [e.fire_id for e in events]
    assert len(fire_ids) == len(set(fire_ids))  # and the log holds each fire once
    assert fire_ids[: len(logged)] == logged


async def _events_of(state_dir: Path) -> list[FiredEvent]:
    store = SqliteJobStore.in_state_dir(str(state_dir))
    await store.open()
    try:
        return await store.events()
    finally:
        await store.aclose()


async def test_service_on_fire_failures_are_retried_in_order_while_running(
    clock: trio.testing.MockClock, tmp_path: Path, supervisor: Supervisor
) -> None:
    calls: list[str] = []
    down = True

    async def flaky(event: FiredEvent) -> None:
        calls.append(event.fire_id)
        if down:
            raise RuntimeError("host is down")

    async with cron_service(tmp_path, supervisor, WallClock(), on_fire=flaky) as cron:
        await cron.add(Every(10, anchor=T0), SystemEvent("tick"))
        await cron.add(At(T0 + timedelta(seconds=15)), SystemEvent("once"))
        await trio.sleep(25)  # fires at 10 s, 15 s, 20 s, each refused, retried with back-off
        refused = await cron.events()
        assert [e.text for e in refused] == ["tick", "once", "tick"]
        assert await cron.store.unacked_events() == refused
        down = False
        calls.clear()
        # The back-off is at most 30 s by now. Not up to a due time (60 s): a fire logged at that very
        # instant may not be handed over yet when the log is read.
        await trio.sleep(34)
        assert await cron.store.unacked_events() == []
        retried = [c for c in calls if c in {e.fire_id for e in refused}]
        assert retried == [e.fire_id for e in refused]  # each once, in cursor order
        assert sorted(calls) == sorted(e.fire_id for e in await cron.events())  # new fires once too


async def test_service_removed_job_with_a_committed_fire_still_delivers_it(
    clock: trio.testing.MockClock, tmp_path: Path, supervisor: Supervisor
) -> None:
    got: list[FiredEvent] = []

    async def on_fire(event: FiredEvent) -> None:
        got.append(event)

    async with cron_service(tmp_path, supervisor, WallClock(), on_fire=on_fire) as cron:
        job = await cron.add(OnExit("true", cwd=str(tmp_path)), SystemEvent("done"), enabled=False)
        fire = text_fire(job.name, "exited before the removal")
        # an exit watcher committed it, then the job is removed
        await cron.store.commit_fire(job.id, exited, fire)
        await cron.remove(job.id)
        assert [e.fire_id for e in got] == [fire.fire_id]
        assert [e.fire_id for e in await cron.events()] == [fire.fire_id]
        assert await cron.store.unacked_events() == []
        # a fire committed after the removal (a run that ended late) is not logged
        assert await cron.fire_pending(job.id, text_fire(job.name, "too late")) is None
        assert len(await cron.events()) == 1 and len(got) == 1


# -- removal ends a running command (real processes) ------------------------------------------------


async def _wait_for_process(pattern: str) -> None:
    await wait_until(lambda: bool(pgrep(pattern)), interval=0.05)


async def test_service_remove_ends_the_running_command_and_nothing_fires(
    tmp_path: Path, supervisor: Supervisor
) -> None:
    async with cron_service(tmp_path, supervisor, lambda: datetime.now(UTC)) as cron:
        job = await cron.add(Every(2), Command(("sleep", mark("777.21"))))
        await _wait_for_process(rf"^sleep 777\.21{SESSION}$")
        with trio.fail_after(10):
            await cron.remove(job.id)
        assert not pgrep(rf"^sleep 777\.21{SESSION}$")
        assert supervisor.runs(f"cron:{job.id}") == []
        await trio.sleep(2.5)  # past the removed job's next due time
        assert not pgrep(rf"^sleep 777\.21{SESSION}$")
        assert await cron.events() == [] and await cron.list() == []


async def test_service_remove_during_run_now_escalates_and_nothing_fires(
    tmp_path: Path, supervisor: Supervisor
) -> None:
    async with cron_service(tmp_path, supervisor, lambda: datetime.now(UTC)) as cron:
        job = await cron.add(Every(3600), Command(("bash", "-c", f'trap "" INT; sleep {mark("777.204")}')))
        said: list[str] = []

        async def run_now() -> None:
            with pytest.raises(JobNotFoundError) as caught:
                await cron.run_now(job.id)
            said.append(str(caught.value))

        with trio.fail_after(15):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run_now)
                await _wait_for_process(rf"^sleep 777\.204{SESSION}$")
                await cron.remove(job.id)  # SIGINT is ignored: SIGKILL after the grace period
                assert not pgrep(rf"777\.204{SESSION}")
            # run_now ended: the run is over, it fired nothing, and run_now says so (found by a new user)
        assert said == [f"job_id {job.id!r} was removed during its run; nothing fired"]
        assert await cron.events() == [] and await cron.list() == []
        assert not (tmp_path / "cron-logs" / f"{job.id}.stdout.log").exists()


async def test_service_disable_lets_a_running_command_finish_and_fire(
    tmp_path: Path, supervisor: Supervisor
) -> None:
    async with cron_service(tmp_path, supervisor, lambda: datetime.now(UTC)) as cron:
        job = await cron.add(
            Every(3600), Command(("sh", "-c", f"sleep 0.5 && echo finished-{mark('777.3')}"))
        )
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(cron.run_now, job.id)
                await _wait_for_process(rf"finished-777\.3{SESSION}")
                await cron.disable(job.id)
        [event] = await cron.events()
        assert event.exit_code == 0 and event.stdout_tail == f"finished-{mark('777.3')}\n"
        assert not (await cron.get(job.id)).enabled


async def test_service_on_exit_cwd_is_checked_at_add_not_at_enable(
    clock: trio.testing.MockClock, tmp_path: Path, supervisor: Supervisor
) -> None:
    async with cron_service(tmp_path, supervisor, WallClock()) as cron:
        with pytest.raises(InvalidScheduleError, match="cwd '/nonexistent' does not exist"):
            await cron.add(OnExit(command="echo hi", cwd="/nonexistent"), SystemEvent("x"))
        assert await cron.list() == []
        workdir = tmp_path / "work"
        workdir.mkdir()
        job = await cron.add(OnExit("echo hi", cwd=str(workdir)), SystemEvent("x"), enabled=False)
        workdir.rmdir()  # a directory may vanish later: enabling does not look (the watcher retries)
        assert (await cron.enable(job.id)).enabled
        with pytest.raises(InvalidScheduleError, match="cwd"):
            await cron.update(job.id, schedule=OnExit("echo again", cwd=str(workdir)))
        assert (await cron.update(job.id, name="renamed")).name == "renamed"  # no new schedule: no check


# -- many jobs due together: one claim per batch, acks grouped, each fire once ----------------------


class BurstStore(CountingStore):
    """The counting store, keeping each ``ack_events`` transaction; a look that claims nothing takes
    ``slow_look_seconds`` (a busy disk) after its transaction."""

    acks: list[tuple[int, ...]]
    writes: list[str]
    slow_look_seconds = 0.0

    async def ack_events(self, cursors: Iterable[int]) -> None:
        batch = tuple(cursors)
        await super().ack_events(batch)
        self.acks.append(batch)
        self.writes.append("ack")

    async def claim_due(
        self, now: datetime, *, skip: Collection[str] = (), acked: bool, limit: int = CLAIM_BATCH
    ) -> DueClaims:
        due = await super().claim_due(now, skip=skip, acked=acked, limit=limit)
        self.writes.append(f"claim {len(due.claims)}")
        if not due.claims and self.slow_look_seconds:
            await trio.sleep(self.slow_look_seconds)
        return due


def burst_store(tmp_path: Path) -> BurstStore:
    store = BurstStore(str(tmp_path / "cron.sqlite3"))
    store.acks = []
    store.writes = []
    return store


def one_shot(index: int, at: datetime) -> CronJob:
    return CronJob(
        id=f"burst-{index:04d}",
        name=f"tick {index}",
        enabled=True,
        schedule=At(at),
        payload=SystemEvent(f"tick {index}"),
        delete_after_run=False,
        created_at=T0,
        updated_at=T0,
        next_run_at=at,
    )


async def test_service_jobs_due_together_each_fire_once_acked_in_few_commits(
    clock: trio.testing.MockClock, tmp_path: Path, supervisor: Supervisor
) -> None:
    total = 2 * CLAIM_BATCH + 50  # three claims
    due = T0 + timedelta(seconds=30)
    store = burst_store(tmp_path)
    handed: list[str] = []

    async def on_fire(event: FiredEvent) -> None:
        handed.append(event.job_id)

    async with cron_service(tmp_path, supervisor, WallClock(), store=store, on_fire=on_fire) as cron:
        for i in range(total):
            await store.insert_job(one_shot(i, due))
        before = store.reads
        await cron.notify_jobs_changed()
        while len(handed) < total or len(store.acks) == 0 or await store.unacked_events():
            await trio.sleep(1)  # (a store call slower than the autojump threshold moves the clock on)
        await trio.sleep(60)
        assert sorted(handed) == [f"burst-{i:04d}" for i in range(total)]  # each once
        events = await cron.events()
        assert sorted(e.job_id for e in events) == sorted(handed)
        assert sorted(c for batch in store.acks for c in batch) == [e.cursor for e in events]
        assert len(store.acks) <= total // 10  # grouped: not one commit per fire
        # the burst's claims go first, the acks after them (deferred while more was due)
        assert [w for w in store.writes if w != "claim 0"][:3] == [f"claim {CLAIM_BATCH}"] * 2 + ["claim 50"]
        assert store.reads - before <= 4  # a look before the due time, then three claims: no look per fire
        assert all(not j.enabled and j.last_status is JobStatus.OK for j in await cron.list())


async def test_service_burst_of_one_shots_deleted_after_run_each_fire_once_then_go(
    clock: trio.testing.MockClock, tmp_path: Path, supervisor: Supervisor
) -> None:
    """The fires of a burst whose acknowledgement another hand-over wrote end when it is committed
    (``CronTimer._delivered``): each job fires once, is deleted after it, and nothing stays running;
    the claims were made ahead (``prepare_claims``), two jobs edited after that fire as edited."""
    total = CLAIM_BATCH + 30
    due = T0 + timedelta(seconds=30)
    store = burst_store(tmp_path)
    handed: list[FiredEvent] = []

    async def on_fire(event: FiredEvent) -> None:
        handed.append(event)

    async with cron_service(tmp_path, supervisor, WallClock(), store=store, on_fire=on_fire) as cron:
        for i in range(total):
            await store.insert_job(attrs.evolve(one_shot(i, due), delete_after_run=True))
        await cron.notify_jobs_changed()
        await trio.sleep(29.5)  # the claims are made ahead half prepare_ahead_seconds before
        await cron.update("burst-0001", name="edited")
        await cron.update("burst-0002", payload=SystemEvent("edited text"))
        with trio.fail_after(600):
            while len(handed) < total or await cron.list():
                await trio.sleep(1)
        await trio.sleep(60)
        assert sorted(e.job_id for e in handed) == [f"burst-{i:04d}" for i in range(total)]  # each once
        by_job = {e.job_id: e for e in handed}
        assert by_job["burst-0001"].job_name == "edited" and by_job["burst-0002"].text == "edited text"
        assert await cron.list() == [] and await store.unacked_events() == []
        assert cron.timer.running == {} and cron.timer.run_scopes == {}


class PreparingStore(BurstStore):
    """The burst store, noting when (on the wall clock given) the timer asks it to make claims ahead."""

    wall: WallClock
    prepared_at: list[datetime]

    async def prepare_claims(self, until: datetime) -> None:
        self.prepared_at.append(self.wall())
        await super().prepare_claims(until)


async def test_timer_asks_for_the_claims_ahead_half_the_lead_before_without_a_look(
    clock: trio.testing.MockClock, tmp_path: Path, supervisor: Supervisor
) -> None:
    """The timer asks the store to make its claims half ``prepare_ahead_seconds`` before a due time
    (no extra look: no ``claim_due``), and after a burst whose next due time is near, half-way to it
    (the fires just started go first)."""
    wall = WallClock()
    store = PreparingStore(str(tmp_path / "cron.sqlite3"))
    store.acks, store.writes, store.wall, store.prepared_at = [], [], wall, []
    handed: list[datetime] = []

    async def on_fire(event: FiredEvent) -> None:
        handed.append(wall())

    async with cron_service(tmp_path, supervisor, wall, store=store, on_fire=on_fire) as cron:
        lead = store.prepare_ahead_seconds / 2
        first = T0 + timedelta(seconds=30)
        for i in range(20):
            job = attrs.evolve(one_shot(i, first), schedule=Every(1.0, anchor=first))
            await store.insert_job(job)
        before = store.reads
        await cron.notify_jobs_changed()
        await trio.sleep(32.2)
        assert store.reads - before == 4  # the look at the change, then one claim a second: no look ahead
        seconds = [round((at - T0).total_seconds(), 1) for at in store.prepared_at]
        assert seconds[0] == round(30 - lead, 1)  # half the lead before the first due time
        assert seconds[1:] == [30.5, 31.5]  # after each burst: half-way to the next due time
        assert len(handed) == 60 and min(handed) == first


async def test_service_restart_after_the_claim_before_the_ack_delivers_each_fire(
    clock: trio.testing.MockClock, tmp_path: Path, supervisor: Supervisor
) -> None:
    total = CLAIM_BATCH + 20
    due = T0 + timedelta(seconds=30)
    wall = WallClock()
    held: list[str] = []

    async def hangs(event: FiredEvent) -> None:
        held.append(event.fire_id)
        await trio.sleep_forever()  # the engine stops before any on_fire returns

    async with cron_service(tmp_path, supervisor, wall, on_fire=hangs) as cron:
        for i in range(total):
            await cron.store.insert_job(one_shot(i, due))
        await cron.notify_jobs_changed()
        while len(held) < total:
            await trio.sleep(1)  # (a store call slower than the autojump threshold moves the clock on)
        assert len(await cron.store.unacked_events()) == total
    got: list[str] = []

    async def works(event: FiredEvent) -> None:
        got.append(event.fire_id)

    async with cron_service(tmp_path, supervisor, wall, on_fire=works) as cron:
        while len(got) < total or await cron.store.unacked_events():
            await trio.sleep(1)
        await trio.sleep(60)
        assert sorted(got) == sorted(held)  # each claimed fire once more, none claimed again
        assert await cron.store.unacked_events() == []
        assert len(await cron.events()) == total


async def test_service_slow_look_does_not_delay_the_next_due_time(
    clock: trio.testing.MockClock, tmp_path: Path, supervisor: Supervisor
) -> None:
    wall = WallClock()
    store = burst_store(tmp_path)
    fired_at: list[datetime] = []

    async def on_fire(event: FiredEvent) -> None:
        fired_at.append(wall())

    async with cron_service(tmp_path, supervisor, wall, store=store, on_fire=on_fire) as cron:
        store.slow_look_seconds = 5.0  # each look that finds nothing due takes 5 s to come back
        await cron.add(At(T0 + timedelta(seconds=20)), SystemEvent("on time"))
        await trio.sleep(30)
    assert len(fired_at) == 1
    assert fired_at[0] - (T0 + timedelta(seconds=20)) < timedelta(seconds=1)  # not 5 s late


async def test_service_change_during_on_fire_is_seen_after_it(
    clock: trio.testing.MockClock, tmp_path: Path, supervisor: Supervisor
) -> None:
    """A job changed while its fire is handed over is read again before deciding on its deletion."""
    cron_ref: list[CronService] = []

    async def on_fire(event: FiredEvent) -> None:
        await cron_ref[0].update(event.job_id, delete_after_run=True)

    async with cron_service(tmp_path, supervisor, WallClock(), on_fire=on_fire) as cron:
        cron_ref.append(cron)
        job = await cron.add(At(T0 + timedelta(seconds=10)), SystemEvent("once"))
        kept = await cron.add(At(T0 + timedelta(seconds=10)), SystemEvent("kept"), name="kept")
        await trio.sleep(20)
        with pytest.raises(JobNotFoundError):
            await cron.get(job.id)
        with pytest.raises(JobNotFoundError):
            await cron.get(kept.id)  # its handler changed it too
        assert len(await cron.events()) == 2


async def test_service_run_now_at_once_each_call_gets_its_own_runs_fire_id(
    tmp_path: Path, supervisor: Supervisor
) -> None:
    """Two ``run_now`` of one job at the same time: the second waits for the first run, then runs; each
    answers the fire id of its own run's event (the CLI printed the other caller's event too)."""
    async with cron_service(tmp_path, supervisor, lambda: datetime.now(UTC)) as cron:
        job = await cron.add(Every(3600), Command(("sh", "-c", "echo run-$$; sleep 0.3")), name="t")
        text_job = await cron.add(Every(3600), SystemEvent("said"), name="s")
        ids: list[str | None] = []

        async def run(job_id: str) -> None:
            ids.append(await cron.run_now(job_id))

        with trio.fail_after(15):
            async with trio.open_nursery() as nursery:
                for job_id in (job.id, job.id, text_job.id):
                    nursery.start_soon(run, job_id)
        events = {e.fire_id: e for e in await cron.events()}
    assert len(events) == 3 and None not in ids and sorted(ids) == sorted(events)  # type: ignore[type-var]
    outputs = {events[i].stdout_tail for i in ids if i is not None and events[i].job_id == job.id}
    assert len(outputs) == 2  # two runs one after the other, two pids (they had shared one log file)
