"""Exactly once across crashes: a real engine process SIGKILLed at named points, then restarted."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from engine import FiredEvent
from engine.cron import JobStatus
from engine.cron._exit_watchers import HOOK_POINTS, CronExitWatchers

from .children import SESSION, mark, pgrep
from .watch_support import engine_with, wait_events, wait_until

ROOT = Path(__file__).parent.parent
#: ``before_spawn``: the arm is stored, nothing spawned (the next engine runs the command, once);
#: ``spawned``: the command runs and its watch state is not stored yet (found by the exit file in its
#: shim's argv, or by its record). Found by a fresh helper: SIGKILLed while arming 100 jobs, the engine left
#: every started command to be run a second time by the next engine.
POINTS = list(HOOK_POINTS)


def crash_engine(state: Path, point: str, command: str, containment: str = "auto") -> None:
    """Run the crash engine until it kills itself at ``point``."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.crash_watch_engine", str(state), point, command, containment],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == -9, proc.stderr
    assert f"at {point}" in proc.stdout


def shim_pids(state: Path) -> list[int]:
    return pgrep(rf"_shim\.(py|pl|bin) {state}/")


async def one_trial(tmp: Path, point: str, *, late: bool, n: int) -> None:
    state = tmp / f"{point}-{late}-{n}"
    runs = tmp / f"runs-{point}-{late}-{n}"
    command = f"echo run >> {runs}; sleep 0.3; echo done-{n}; exit 5"
    await trio.to_thread.run_sync(crash_engine, state, point, command)
    if late:  # the command ends while no engine runs: its exit is read from the shim's file
        await wait_until(lambda: not shim_pids(state))  # the shim ends right after its command
    async with engine_with(state) as engine:
        (event,) = await wait_events(engine, 1)
        await trio.sleep(0.4)
        assert len(await engine.cron.events()) == 1
        assert engine.watchers.active_job_ids() == []
    assert (event.exit_code, event.stdout_tail) == (5, f"done-{n}\n")
    assert runs.read_text() == "run\n"  # never re-run
    async with engine_with(state) as engine:  # and a further restart fires nothing again
        await trio.sleep(0.2)
        assert len(await engine.cron.events()) == 1


@pytest.mark.parametrize("late", [False, True])
@pytest.mark.parametrize("point", POINTS)
async def test_exit_crash_at_point_fires_exactly_once(tmp_path: Path, point: str, late: bool) -> None:
    # 5 points x 2 timings x 3 trials = 30 trials in CI; more under HYPOTHESIS_PROFILE=dev style runs.
    with trio.fail_after(90):
        for n in range(3):
            await one_trial(tmp_path, point, late=late, n=n)


async def test_exit_crash_adopts_live_command_with_same_pid(tmp_path: Path) -> None:
    state = tmp_path / "s"
    await trio.to_thread.run_sync(crash_engine, state, "after_spawn", f"sleep {mark('0.8')}; echo adopted")
    (shim,) = shim_pids(state)
    async with engine_with(state) as engine:
        (job_id,) = engine.watchers.active_job_ids()
        assert engine.watchers.watched_pid(job_id) == shim  # adopted, not started again
        (event,) = await wait_events(engine, 1)
    assert event.stdout_tail == "adopted\n"
    assert not pgrep(rf"^sleep 0\.8{SESSION}")
    assert not shim_pids(state)


@pytest.mark.parametrize("point", ["after_spawn", "spawned"])
async def test_exit_crash_lost_watch_is_reported_not_rerun(tmp_path: Path, point: str) -> None:
    state = tmp_path / "s"
    await trio.to_thread.run_sync(crash_engine, state, point, f"sleep {mark('30.5')}")
    (shim,) = shim_pids(state)
    leaves = _leaves_of(shim)  # in cgroup containment: the command's leaf, left by the crash
    os.killpg(shim, signal.SIGKILL)  # the shim dies with its command: neither alive nor recorded
    with trio.fail_after(5):
        while pgrep(rf"^sleep 30\.5{SESSION}") or shim_pids(state):
            await trio.sleep(0.02)
    async with engine_with(state) as engine:

        async def disabled() -> bool:
            return not any(job.enabled for job in await engine.cron.list())

        await wait_until(disabled)
        (job,) = await engine.cron.list()
        assert not job.enabled
        assert job.last_error is not None and "watch lost across restart" in job.last_error
        # Found by a fresh tester: listed with no status, a lost watch looked like a job that never ran.
        assert job.last_status is JobStatus.INTERRUPTED
        assert await engine.cron.events() == []
        assert not pgrep(rf"sleep 30\.5{SESSION}")
    # Found by a fresh helper: the lost watch's leaf (and so the engine's cgroup) outlived the engine.
    assert not [leaf for leaf in leaves if os.path.exists(leaf)]


@pytest.mark.parametrize("point", ["after_spawn", "spawned"])
async def test_exit_crash_shim_killed_alone_is_a_lost_watch_whose_command_is_ended(
    tmp_path: Path, containment: str, point: str
) -> None:
    """Its shim SIGKILLed while no engine runs, the command runs on with nothing to record its end: the
    watch is lost (the job disabled, nothing fired), and the next engine ends the command, in
    process-group containment too (found by a fresh tester: the command ran on, watched by nobody).
    ``spawned``: the engine was killed before it stored the command's state (the arm alone is stored):
    the command is found by the session of the shim whose pid its reserved record names (a double fault
    left open last round: in process-group containment the command ran on)."""
    state = tmp_path / "s"
    # One sleep per case: a case that fails leaves its command running, and must not fail the next.
    base = f"30.7{POINTS.index(point)}{int(containment == 'cgroup')}"
    await trio.to_thread.run_sync(crash_engine, state, point, f"sleep {mark(base)}", containment)
    sleeping = rf"^sleep {re.escape(base)}{SESSION}"
    (shim,) = shim_pids(state)
    await wait_until(lambda: bool(pgrep(sleeping)))  # the shim has run the command
    os.kill(shim, signal.SIGKILL)  # the shim alone: its command runs on
    with trio.fail_after(5):
        while shim_pids(state):
            await trio.sleep(0.02)
    assert pgrep(sleeping)
    async with engine_with(state, containment=containment) as engine:

        async def disabled() -> bool:
            return not any(job.enabled for job in await engine.cron.list())

        await wait_until(disabled)
        (job,) = await engine.cron.list()
        gone = "the command's shim" if point == "after_spawn" else "the engine stopped while it started"
        assert job.last_error is not None and f"watch lost across restart: {gone}" in job.last_error
        assert "shim is not running" in job.last_error
        await wait_until(lambda: not pgrep(sleeping))
        assert await engine.cron.events() == []


async def test_exit_crash_what_an_adopted_command_left_is_ended_once_it_exits(
    tmp_path: Path, containment: str
) -> None:
    """Found by a fresh tester: in process-group containment a ``sleep &`` of a command adopted after a
    crash ran on once the command had exited and fired (without a restart, or in cgroup containment, it
    was ended). Its group and marked processes are now ended after the fire, as its leaf was."""
    state = tmp_path / "s"
    base = f"30.9{int(containment == 'cgroup')}"
    left = rf"^sleep {re.escape(base)}{SESSION}"
    command = f"sleep {mark(base)} & setsid sleep {mark(base)} & sleep 3; echo done"
    await trio.to_thread.run_sync(crash_engine, state, "after_spawn", command, containment)
    (shim,) = shim_pids(state)
    async with engine_with(state, containment=containment) as engine:
        (job_id,) = engine.watchers.active_job_ids()
        assert engine.watchers.watched_pid(job_id) == shim  # adopted running: not ended while no engine ran
        await wait_until(lambda: len(pgrep(left)) == 2)
        (event,) = await wait_events(engine, 1)
        assert (event.exit_code, event.stdout_tail) == (0, "done\n")
        await wait_until(lambda: not pgrep(left))


async def test_exit_crash_adopted_command_held_back_is_noted_at_once_until_it_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command adopted after a crash while a file of the user's (here ``BASH_ENV``) still holds it back
    gets the note a fresh one gets ("has not started yet"), counted from its own start: held back longer
    than ``start_hint_seconds`` already, it has the note at once; the note goes when it starts. (The
    adopting engine said nothing: the job looked armed and well while its command never ran.)"""
    hint = 2.0
    profile_gate, command_gate = tmp_path / "profile-gate", tmp_path / "command-gate"
    env_file = tmp_path / "bash_env"
    env_file.write_text(f"while [ ! -e {profile_gate} ]; do sleep 0.05; done\n")
    monkeypatch.setenv("BASH_ENV", str(env_file))  # the crash engine's bash reads it, and marks the start
    monkeypatch.setattr(
        "engine._engine.CronExitWatchers", functools.partial(CronExitWatchers, start_hint_seconds=hint)
    )
    state = tmp_path / "s"
    command = f"echo started; while [ ! -e {command_gate} ]; do sleep 0.05; done"
    try:
        with trio.fail_after(60):
            await trio.to_thread.run_sync(crash_engine, state, "after_spawn", command)
            spawned = trio.current_time()
            (shim,) = shim_pids(state)
            await trio.sleep(hint + 0.5 - (trio.current_time() - spawned))  # held back past the hint
            async with engine_with(state) as adopting:
                adopted = trio.current_time()
                (job_id,) = adopting.watchers.active_job_ids()
                assert adopting.watchers.watched_pid(job_id) == shim
                await wait_until(lambda: adopting.watchers.last_error(job_id) is not None)
                assert trio.current_time() - adopted < hint  # at once, not start_hint_seconds later
                note = adopting.watchers.last_error(job_id)
                assert note is not None and note.startswith(
                    f"the watched command has not started yet: after {hint:g} s the shell (in the shim, "
                    f"pid {shim})"
                )
                # what holds it back is named, with what runs none (a tester was told to use the
                # `bash -c --` shell it already had)
                assert f"(the file BASH_ENV names, {str(env_file)!r} waiting on something?)" in note
                assert note.endswith("; unset BASH_ENV in the engine's environment to run none")
                stored = await adopting.cron.get(job_id)
                assert (stored.enabled, stored.last_status, stored.last_error) == (True, None, note)
                profile_gate.touch()
                released = time.monotonic()
                await wait_until(lambda: adopting.watchers.last_error(job_id) is None)

                async def cleared() -> bool:
                    return (await adopting.cron.get(job_id)).last_error is None

                await wait_until(cleared)
                assert adopting.watchers.active_job_ids() == [job_id]  # running, without the note
                command_gate.touch()
                ran = time.monotonic() - released
                (event,) = await wait_events(adopting, 1)
    finally:  # both gates open: whatever was started ends by itself
        profile_gate.touch()
        command_gate.touch()
    assert (event.job_id, event.exit_code, event.reason, event.stdout_tail) == (
        job_id,
        0,
        "exit",
        "started\n",
    )
    # The command's own time, from its start mark, as for a fresh command: not from the spawn, which
    # would add the hint's 2.5 s and more that the profile held it back (found by a tester: 32 s for a
    # command of 2 s held back 30 s).
    assert event.duration_seconds is not None and event.duration_seconds < ran + 1.0  # held back >= 2.5 s
    assert not shim_pids(state)


@pytest.mark.parametrize("left", ["nothing", "empty logs", "a reserved record", "output"])
async def test_exit_crash_before_the_spawn_runs_the_command_only_if_nothing_shows_it_ran(
    tmp_path: Path, left: str
) -> None:
    """Killed with the arm stored (``before_spawn``), where no shim runs and no record is there: the next
    engine runs the command, once, unless something shows that it may have run: the temp file a shim
    reserves for its record before running the command, or output in the arm's logs (made empty before
    the spawn). Then the watch is reported lost and the command is not run again (fail-closed)."""
    state, runs = tmp_path / "s", tmp_path / "runs"
    await trio.to_thread.run_sync(crash_engine, state, "before_spawn", f"echo run >> {runs}; exit 3")
    with contextlib.closing(sqlite3.connect(f"file:{state / 'cron.sqlite3'}?mode=ro", uri=True)) as conn:
        ((job_id, text),) = conn.execute("SELECT id, watch_state FROM jobs").fetchall()
    arm = json.loads(text)
    assert arm["spawning"] is True and "pid" not in arm
    base = state / "watch-logs" / f"{job_id}.{arm['arm_id']}"
    base.parent.mkdir(mode=0o700, exist_ok=True)
    if left != "nothing":  # as if killed between the logs' making and the spawn, or after the spawn
        for stream in ("stdout", "stderr"):
            Path(f"{base}.{stream}.log").write_text("partial\n" if left == "output" else "")
    if left == "a reserved record":
        Path(arm["exit_file"] + ".tmp.4194301").write_text(" " * 4096)
    async with engine_with(state) as engine:
        if left in ("nothing", "empty logs"):
            (event,) = await wait_events(engine, 1)
            assert event.exit_code == 3
            assert runs.read_text() == "run\n"
            return

        async def disabled() -> bool:
            return not (await engine.cron.get(job_id)).enabled

        await wait_until(disabled)
        error = (await engine.cron.get(job_id)).last_error
        assert error is not None and "watch lost across restart" in error
        assert "while it started the command" in error
        await trio.sleep(0.3)
        assert await engine.cron.events() == []
    assert not runs.exists()
    assert not Path(arm["exit_file"] + ".tmp.4194301").exists()


def _leaves_of(pid: int) -> list[str]:
    """The watched command's cgroup leaf of the process ``pid`` (none in process-group containment)."""
    rel = Path(f"/proc/{pid}/cgroup").read_text().partition("0::")[2].strip()
    found = [str(mount) + rel for mount in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))]
    return [path for path in found if Path(path).name.startswith("w-") and os.path.isdir(path)]


async def test_exit_crash_in_on_fire_delivers_same_fire_id_again(tmp_path: Path) -> None:
    state = tmp_path / "s"
    await trio.to_thread.run_sync(crash_engine, state, "on_fire", "echo embedded")
    received: list[FiredEvent] = []

    async def on_fire(event: FiredEvent) -> None:
        received.append(event)

    async with engine_with(state, on_fire=on_fire):
        await wait_until(lambda: bool(received))
        await trio.sleep(0.3)
    first = (state / "received").read_text().split()
    assert [e.fire_id for e in received] == first  # at least once, deduplicated by fire_id
    async with engine_with(state, on_fire=on_fire):
        await trio.sleep(0.3)
    assert len(received) == 1
