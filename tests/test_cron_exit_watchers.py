"""On-exit watchers with real commands: persist before fire, one fire per exit, re-arming, failures."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
from datetime import UTC, datetime
from pathlib import Path

import attrs
import pytest
import trio

from engine import (
    CronJob,
    FiredEvent,
    InvalidArgumentError,
    InvalidScheduleError,
    OnExit,
    SqliteJobStore,
    SystemEvent,
)
from engine._procfs import children_of
from engine.cron._exit_watchers import CronExitWatchers
from engine.cron._shell import COMMAND_VAR, MAX_COMMAND_BYTES, resolve_exit_watch_shell, runs_user_files_first

from .children import SESSION, kill_leftovers, kill_pids, mark, pgrep, pgrep_env
from .watch_support import FlakyStore, end_left_commands, engine_with, wait_events, wait_until


async def test_exit_watcher_persists_before_it_fires(tmp_path: Path) -> None:
    order: list[str] = []
    seen_at_fire: list[CronJob] = []
    fired: list[FiredEvent] = []

    async def after_persist(job_id: str) -> None:
        order.append("persisted")

    async def on_fire(event: FiredEvent) -> None:
        order.append("fired")
        seen_at_fire.append(await engine.cron.get(event.job_id))
        fired.append(event)

    d = tmp_path / "d"
    d.mkdir()
    async with engine_with(tmp_path / "s", hooks={"after_persist": after_persist}, on_fire=on_fire) as engine:
        job = await engine.cron.add(
            OnExit(command="echo out; echo err >&2; exit 3", cwd=str(d)), SystemEvent("tests finished")
        )
        await wait_until(lambda: bool(fired))
        (event,) = await engine.cron.events()
    assert order == ["persisted", "fired"]
    assert not seen_at_fire[0].enabled  # the job was disabled before the fire was delivered
    assert (event.job_id, event.exit_code, event.signal, event.reason) == (job.id, 3, None, "exit")
    assert event.stdout_tail == "out\n" and event.stderr_tail == "err\n"
    assert event.text.startswith("tests finished\n")
    assert "exited with code 3" in event.text and "echo out; echo err >&2; exit 3" in event.text
    assert fired[0].fire_id == event.fire_id
    stored = seen_at_fire[0]
    assert stored.last_status is not None and stored.last_status.value == "error"


async def test_exit_watcher_fires_once_and_new_engine_does_not_spawn_again(tmp_path: Path) -> None:
    marker = tmp_path / "runs.txt"
    async with engine_with(tmp_path / "s") as engine:
        job = await engine.cron.add(OnExit(command=f"echo run >> {marker}"), SystemEvent("ran"))
        await wait_events(engine, 1)
        await trio.sleep(0.3)
        assert len(await engine.cron.events()) == 1
        assert engine.watchers.active_job_ids() == []
    async with engine_with(tmp_path / "s") as engine:
        await trio.sleep(0.5)
        assert engine.watchers.active_job_ids() == []
        assert len(await engine.cron.events()) == 1
        assert not (await engine.cron.get(job.id)).enabled
    assert marker.read_text() == "run\n"


@pytest.mark.parametrize(("name", "number"), [("SEGV", 11), ("KILL", 9)])
async def test_exit_watcher_reports_signal_death(tmp_path: Path, name: str, number: int) -> None:
    async with engine_with(tmp_path / "s") as engine:
        job = await engine.cron.add(OnExit(command=f"kill -{name} $$"), SystemEvent("crashed"))
        (event,) = await wait_events(engine, 1)
        # In words, as the event says it (was "ended: exit None, signal 11" in `cron get`).
        stored = await engine.cron.get(job.id)
        assert stored.last_error == f"'kill -{name} $$' was killed by signal {number} (SIG{name})"
    assert (event.exit_code, event.signal, event.reason) == (None, number, "signal")
    assert f"killed by signal {number} (SIG{name})" in event.text
    assert event.stderr_tail == ""  # the shim ends the same way, quietly (no traceback of ours)


async def test_exit_watcher_fire_tail_is_bounded(tmp_path: Path) -> None:
    async with engine_with(tmp_path / "s") as engine:
        await engine.cron.add(OnExit(command="seq 1 200000"), SystemEvent("big"))
        (event,) = await wait_events(engine, 1, seconds=20)
    assert event.stdout_tail.endswith("200000\n")
    assert len(event.stdout_tail.splitlines()) <= 50 and len(event.stdout_tail) <= 4096
    assert event.truncated
    assert len(event.text) < 10_000


# ---- CR-01: the command string reaches bash exactly -------------------------------------------

CR01 = {
    "q1": (
        """printf '%s|' "it's" 'say "hi"' "back\\\\slash" '$HOME'; echo""",
        """it's|say "hi"|back\\slash|$HOME|\n""",
        0,
    ),
    "q2": ("echo line-one\necho line-two\nexit 3", "line-one\nline-two\n", 3),
    "q3": ("cat <<'EOF'\n$not_expanded \"dq\" 'sq' `nope`\nEOF", "$not_expanded \"dq\" 'sq' `nope`\n", 0),
    "q4": ("echo '100% {job} %s %(x)s'", "100% {job} %s %(x)s\n", 0),
    "q5": ("echo cont-\\\nnued", "cont-nued\n", 0),
    "q6": ("x=$(printf 'a\\nb'); echo \"[$x]\"", "[a\nb]\n", 0),
    "q7": ("-x", "", 127),
}


def login_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, profile: str) -> None:
    """Point HOME at a fresh folder whose ``.bash_profile`` is ``profile`` (what a login shell reads)."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bash_profile").write_text(profile)
    monkeypatch.setenv("HOME", str(home))


async def test_exit_watcher_cr01_login_shell_runs_command_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    login_home(tmp_path, monkeypatch, "echo PROFILE-NOISE\ncd /\n")
    d = tmp_path / "D"
    d.mkdir()
    cases = {**CR01, "q8": ('pwd; echo "$PWD"', f"{d}\n{d}\n", 0)}
    async with engine_with(tmp_path / "s", exit_watch_shell=resolve_exit_watch_shell()) as engine:
        assert engine.watchers.shell == ("bash", "-lc", "--")
        ids = {}
        for name, (command, _out, _code) in cases.items():
            ids[(await engine.cron.add(OnExit(command=command, cwd=str(d)), SystemEvent(name))).id] = name
        events = await wait_events(engine, len(cases), seconds=20)
    by_name = {ids[e.job_id]: e for e in events}
    for name, (_command, out, code) in cases.items():
        event = by_name[name]
        assert event.exit_code == code, name
        # The profile's noise comes first; the command's own output is the end of the stream.
        assert event.stdout_tail.endswith(out), (name, event.stdout_tail)
        assert event.stdout_tail in (out, "PROFILE-NOISE\n" + out), name
    assert "-x: command not found" in by_name["q7"].stderr_tail


async def test_exit_watcher_cr01_profile_replacing_shell_is_diagnosed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    login_home(tmp_path, monkeypatch, "exec sh -c 'exit 0'\n")
    async with engine_with(tmp_path / "s", exit_watch_shell=("bash", "-lc", "--")) as engine:
        await engine.cron.add(OnExit(command="echo never"), SystemEvent("replaced"))
        (event,) = await wait_events(engine, 1)
    assert event.reason == "not_started"
    assert "did not run" in event.text


async def test_a_login_profile_that_holds_the_command_back_is_noted_until_it_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A profile that waits (here on a file; on the machine that found it, a stale ``pyenv`` lock) left
    the job enabled with nothing to say why its command did not run: now ``last_error`` says so, from
    ``start_hint_seconds`` until the command starts, and the status is left as it was."""
    profile_gate, command_gate = tmp_path / "profile-gate", tmp_path / "command-gate"
    login_home(tmp_path, monkeypatch, f"while [ ! -e {profile_gate} ]; do sleep 0.05; done\n")
    async with engine_with(tmp_path / "s", exit_watch_shell=("bash", "-lc", "--")) as engine:
        engine.watchers.start_hint_seconds = 0.3
        command = f"echo started; while [ ! -e {command_gate} ]; do sleep 0.05; done"
        job = await engine.cron.add(OnExit(command=command), SystemEvent("slow"))
        await wait_until(lambda: engine.watchers.last_error(job.id) is not None)
        note = engine.watchers.last_error(job.id)
        assert note is not None and note.startswith("the watched command has not started yet: after 0.3 s")
        assert "a login profile waiting on something?" in note
        assert ".stdout.log and " in note  # a profile's echo goes to stdout (it named stderr alone)
        stored = await engine.cron.get(job.id)
        assert (stored.enabled, stored.last_status, stored.last_error) == (True, None, note)
        await trio.sleep(1.0)  # the profile holds the command back a while longer
        profile_gate.touch()
        await wait_until(lambda: engine.watchers.last_error(job.id) is None)
        with trio.fail_after(10):
            while (await engine.cron.get(job.id)).last_error is not None:
                await trio.sleep(0.02)
        assert engine.watchers.active_job_ids() == [job.id]  # still running, now without the note
        command_gate.touch()
        (event,) = await wait_events(engine, 1)
        done = await engine.cron.get(job.id)
    assert (event.exit_code, event.reason, event.stdout_tail) == (0, "exit", "started\n")
    assert done.last_error is None and done.last_status is not None and done.last_status.value == "ok"
    # The command's own time, from its start mark: the profile's wait (1.3 s and more) is not in it.
    assert event.duration_seconds is not None and event.duration_seconds < 1.0


async def test_exit_watcher_last_command_replaces_the_shell(tmp_path: Path) -> None:
    """The command's last simple command runs in the shell's own process, as with ``bash -c`` (the
    wrapper's ``eval`` used to fork it: one more bash per watched command); earlier lines still run
    first, in order, and the started mark is there."""
    out = tmp_path / "first"
    async with engine_with(tmp_path / "s") as engine:
        command = f"echo one > {out}\nsleep {mark('337.5')}"
        job = await engine.cron.add(OnExit(command=command), SystemEvent("x"))
        await wait_until(lambda: engine.watchers.watched_pid(job.id) is not None)
        shim = engine.watchers.watched_pid(job.id)
        assert shim is not None
        await wait_until(lambda: bool(pgrep(rf"^sleep 337\.5{SESSION}")))
        (shell,) = children_of(shim) or []
        assert pgrep(rf"^sleep 337\.5{SESSION}") == [shell]  # the shell became the sleep
        assert children_of(shell) == []
        assert out.read_text() == "one\n"
        await engine.cron.remove(job.id)


async def test_exit_watcher_runs_lines_as_bash_c_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lines before a syntax error run, as in ``bash -c`` (bash reads one line at a time); the error
    ends the command with status 2 and its message, not as a command that never started."""
    login_home(tmp_path, monkeypatch, "cd /\n")
    async with engine_with(tmp_path / "s", exit_watch_shell=("bash", "-lc", "--")) as engine:
        await engine.cron.add(OnExit(command="echo before\nif"), SystemEvent("syntax"))
        (event,) = await wait_events(engine, 1, seconds=20)
    assert event.exit_code == 2
    assert event.reason != "not_started"
    assert event.stdout_tail.endswith("before\n")
    assert "syntax error" in event.stderr_tail


@pytest.mark.parametrize(("shell", "marked"), [(("bash", "-c", "--"), False), (("bash", "-lc", "--"), True)])
async def test_exit_watcher_marks_the_start_only_where_a_profile_runs_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shell: tuple[str, ...], marked: bool
) -> None:
    """The started mark costs each arm a file: it is made where bash runs a file of the user's first
    (here the login profile), not where nothing can run before the command."""
    login_home(tmp_path, monkeypatch, "cd /\n")
    monkeypatch.delenv("BASH_ENV", raising=False)
    marker = mark("337.6")
    try:
        async with engine_with(tmp_path / "s", exit_watch_shell=shell) as engine:
            job = await engine.cron.add(OnExit(command=f"sleep {marker}"), SystemEvent("x"))
            await wait_until(lambda: bool(pgrep(rf"^sleep {marker}$")))
            started = list((tmp_path / "s" / "watch-logs").glob(f"{job.id}.*.started"))
            assert len(started) == (1 if marked else 0)
            await engine.cron.remove(job.id)
    finally:
        kill_leftovers(rf"^sleep {marker}$")


async def test_exit_watcher_bash_env_replacing_the_shell_is_diagnosed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``BASH_ENV`` runs before the command of any non-interactive bash, ``bash -c`` too: the start is
    marked then, and a file there that replaces the shell is diagnosed as with a profile."""
    env_file = tmp_path / "bash_env"
    env_file.write_text("exec sh -c 'exit 0'\n")
    monkeypatch.setenv("BASH_ENV", str(env_file))
    async with engine_with(tmp_path / "s") as engine:
        await engine.cron.add(OnExit(command="echo never"), SystemEvent("replaced"))
        (event,) = await wait_events(engine, 1)
    assert event.reason == "not_started"
    assert event.stdout_tail == ""


@pytest.mark.parametrize("ended", ["while adopted", "while no engine ran"])
async def test_exit_watcher_profile_replacing_shell_is_diagnosed_across_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ended: str
) -> None:
    # Found in review: the engine that started the command looked for the mark, the next one did not
    # (the event said exit 0). The watch state now says a mark is due.
    flag = tmp_path / "go"
    login_home(tmp_path, monkeypatch, f"while [ ! -e {flag} ]; do sleep 0.05; done\nexec sh -c 'exit 0'\n")
    shell = ("bash", "-lc", "--")
    async with engine_with(tmp_path / "s", exit_watch_shell=shell) as engine:
        job = await engine.cron.add(OnExit(command="echo never"), SystemEvent("replaced"))
        await wait_until(lambda: engine.watchers.watched_pid(job.id) is not None)
    # The engine stopped gracefully: the profile still runs, the command has not started.
    if ended == "while no engine ran":
        flag.touch()
        logs = tmp_path / "s" / "watch-logs"
        await wait_until(lambda: bool(list(logs.glob(f"{job.id}.*.exit.json"))))  # the shim recorded it
    async with engine_with(tmp_path / "s", exit_watch_shell=shell) as engine:
        flag.touch()
        (event,) = await wait_events(engine, 1)
    assert (event.job_id, event.reason) == (job.id, "not_started")
    assert "did not run" in event.text


async def test_an_adopted_command_held_back_is_noted_until_it_starts_and_a_stale_note_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next engine adopts a command that a file of the user's (here ``BASH_ENV``) still holds back:
    it notes so at once (held back since its spawn, past ``start_hint_seconds``), as the engine that
    started it did, and the note goes once the command starts. A note in the store from before (what
    an engine killed while noting leaves) is not put back then."""
    profile_gate, command_gate = tmp_path / "profile-gate", tmp_path / "command-gate"
    env_file = tmp_path / "bash_env"
    env_file.write_text(f"while [ ! -e {profile_gate} ]; do sleep 0.05; done\n")
    monkeypatch.setenv("BASH_ENV", str(env_file))
    monkeypatch.setattr(
        "engine._engine.CronExitWatchers", functools.partial(CronExitWatchers, start_hint_seconds=1.0)
    )
    command = f"echo started; while [ ! -e {command_gate} ]; do sleep 0.05; done"
    try:
        async with engine_with(tmp_path / "s") as first:
            job = await first.cron.add(OnExit(command=command), SystemEvent("held"))
            await wait_until(lambda: first.watchers.last_error(job.id) is not None)
            note = first.watchers.last_error(job.id)
            assert note is not None and note.startswith("the watched command has not started yet")
        # Stopped gracefully (the note was taken back); put it back as a SIGKILLed engine leaves it.
        store = SqliteJobStore.in_state_dir(str(tmp_path / "s"))
        await store.open()
        try:
            await store.update_job(job.id, lambda stale: attrs.evolve(stale, last_error=note))
        finally:
            await store.aclose()
        async with engine_with(tmp_path / "s") as adopting:
            assert adopting.watchers.active_job_ids() == [job.id]
            await wait_until(lambda: adopting.watchers.last_error(job.id) == note, seconds=0.8)  # at once
            profile_gate.touch()
            await wait_until(lambda: adopting.watchers.last_error(job.id) is None)

            async def cleared() -> bool:
                return (await adopting.cron.get(job.id)).last_error is None

            await wait_until(cleared)
            assert adopting.watchers.active_job_ids() == [job.id]  # running, without the note
            command_gate.touch()
            (event,) = await wait_events(adopting, 1)
    finally:  # both gates open: whatever was started ends by itself
        profile_gate.touch()
        command_gate.touch()
    assert (event.exit_code, event.reason, event.stdout_tail) == (0, "exit", "started\n")


@pytest.mark.parametrize(
    ("shell", "reads"),
    [
        (("bash", "-eo", "pipefail", "-lc", "--"), True),
        (("bash", "-euo", "pipefail", "-c", "--"), False),
        (("bash", "-eO", "extglob", "-c"), False),
        (("bash", "+O", "extglob", "-lc"), True),
        (("bash", "-o", "pipefail", "-o", "nounset", "-c", "--"), False),
        (("bash", "--login", "-c"), True),
        (("bash", "--noprofile", "--norc", "-c", "--"), False),
        (("bash", "--rcfile", "x", "-ic"), True),
        (("bash", "-ic"), True),
        (("bash", "-c", "--"), False),
    ],
)
def test_which_bash_reads_a_users_file_first(
    monkeypatch: pytest.MonkeyPatch, shell: tuple[str, ...], reads: bool
) -> None:
    # Found in review: "-eo pipefail -lc" was read as ending at "pipefail", so a login shell got no mark.
    monkeypatch.delenv("BASH_ENV", raising=False)
    assert runs_user_files_first(shell) is reads
    monkeypatch.setenv("BASH_ENV", "/nonexistent")
    assert runs_user_files_first(shell)
    monkeypatch.setenv("BASH_ENV", "")  # set and empty (found by a fresh tester): bash reads no file
    assert runs_user_files_first(shell) is reads


async def test_exit_watcher_longest_command_runs_and_one_byte_more_is_refused(tmp_path: Path) -> None:
    # Found in review: the wrapper's first line shares the command's argument, so a command near the
    # argument limit never started (E2BIG, retried for ever) although `cron add` took it.
    guide = (Path(__file__).parent.parent / "docs" / "guide-on-exit.md").read_text()
    assert f"{MAX_COMMAND_BYTES:,} bytes" in " ".join(guide.split())  # the guide states the limit
    longest = "true #" + "x" * (MAX_COMMAND_BYTES - 6)
    async with engine_with(tmp_path / "s") as engine:
        with pytest.raises(InvalidScheduleError, match=f"at most {MAX_COMMAND_BYTES}"):
            await engine.cron.add(OnExit(command=longest + "x"), SystemEvent("too long"))
        await engine.cron.add(OnExit(command=longest), SystemEvent("longest"))
        (event,) = await wait_events(engine, 1)
    assert (event.exit_code, event.reason) == (0, "exit")


# ---- CR-02: re-arming while the previous command exits ---------------------------------------


async def _cr02_round(state: Path, offset: float, *, hold: str | None, tag: str) -> tuple[FiredEvent, int]:
    held = trio.Event()
    release = trio.Event()

    async def hook(job_id: str) -> None:
        if not held.is_set():
            held.set()
            await release.wait()

    gen1 = f"sleep 0.5; echo gen-1-{tag}; exit 11"
    gen2 = f"sleep 2; echo gen-2-{tag}; exit 22"
    async with engine_with(state, hooks={hold: hook} if hold else None) as engine:
        job = await engine.cron.add(OnExit(command=gen1), SystemEvent("cr02"))
        if hold:
            with trio.fail_after(10):
                await held.wait()  # gen-1 exited; its watcher is held before the persist
        else:
            await trio.sleep(offset)
        current = await engine.cron.get(job.id)  # J' from the store's record at this moment
        await engine.watchers.reconcile([attrs.evolve(current, schedule=OnExit(command=gen2))])
        release.set()
        if engine.watchers.active_job_ids():
            # Replaced: once gen-2 runs, gen-1 is gone (the scope replaces the existing one before it
            # spawns). The command string travels in the wrapper's environment, so look there.
            await wait_until(
                lambda: (
                    bool(pgrep_env(COMMAND_VAR, f"echo gen-2-{tag}")) or not engine.watchers.active_job_ids()
                ),
                seconds=10,
            )
            assert not pgrep_env(COMMAND_VAR, f"echo gen-1-{tag}")
        events = await wait_events(engine, 1, seconds=15)
        await trio.sleep(0.2)
        events = await engine.cron.events()
        assert engine.watchers.active_job_ids() == []
    assert len(events) == 1, events
    return events[0], len(events)


async def test_exit_watcher_cr02_rearm_race_fires_exactly_once(tmp_path: Path) -> None:
    rng = random.Random(2026)
    results: dict[int, FiredEvent] = {}

    async def one(n: int) -> None:
        hold = {0: "after_exit", 1: "before_persist"}.get(n)
        tag = f"{n}-{SESSION}"
        event, _ = await _cr02_round(tmp_path / f"s{n}", rng.uniform(0.40, 0.55), hold=hold, tag=tag)
        results[n] = event

    with trio.fail_after(120):
        for batch in range(0, 50, 10):
            async with trio.open_nursery() as nursery:
                for n in range(batch, batch + 10):
                    nursery.start_soon(one, n)
    generations = {1: 0, 2: 0}
    for n, event in results.items():
        if event.exit_code == 11:
            assert event.stdout_tail == f"gen-1-{n}-{SESSION}\n"
            generations[1] += 1
        else:
            assert event.exit_code == 22, event
            assert event.stdout_tail.endswith(f"gen-2-{n}-{SESSION}\n")
            generations[2] += 1
    # Held after gen-1 exited, before its commit began: reconcile replaced the arm, gen-1 never persists.
    assert results[0].exit_code == 22
    # Held inside the commit: the commit decides; it succeeds, so gen-1 is the one fire and no gen-2.
    assert results[1].exit_code == 11
    assert sum(generations.values()) == 50
    assert not pgrep(rf"echo gen-[12]-[0-9]+-{SESSION}")


async def test_a_changed_command_starts_once_the_old_one_has_ended(tmp_path: Path) -> None:
    """A re-arm stores its arm and spawns only after the job's older command has ended (the older
    watcher is done): the old arm's state stays in the store for the next engine until then."""
    order = tmp_path / "order"
    ending = f"trap 'sleep 1; echo old-ended >> {order}; exit 0' INT"
    old = f"{ending}; echo old >> {order}; sleep {mark('337.1')} & wait"
    async with engine_with(tmp_path / "s", grace_seconds=5.0) as engine:
        job = await engine.cron.add(OnExit(command=old), SystemEvent("J"))
        await wait_until(lambda: order.exists())
        (before,) = (await engine.cron.store.watch_states()).values()
        await engine.cron.update(job.id, schedule=OnExit(command=f"echo new >> {order}"))
        await trio.sleep(0.5)  # the old command is in its trap
        assert await engine.cron.store.watch_states() == {job.id: before}
        (event,) = await wait_events(engine, 1)
    assert event.exit_code == 0
    assert order.read_text() == "old\nold-ended\nnew\n"


async def test_exit_watcher_unchanged_reconcile_keeps_watcher(tmp_path: Path) -> None:
    async with engine_with(tmp_path / "s") as engine:
        job = await engine.cron.add(OnExit(command=f"sleep {mark('335.1')}"), SystemEvent("x"))
        await wait_until(lambda: engine.watchers.watched_pid(job.id) is not None)
        pid = engine.watchers.watched_pid(job.id)
        await engine.watchers.reconcile(await engine.cron.list())
        await engine.cron.update(job.id, payload=SystemEvent("payload only"))
        await trio.sleep(0.2)
        assert engine.watchers.watched_pid(job.id) == pid
        assert await engine.cron.events() == []


async def test_exit_watcher_payload_change_uses_newest_job(tmp_path: Path) -> None:
    flag = tmp_path / "go"
    async with engine_with(tmp_path / "s") as engine:
        job = await engine.cron.add(
            OnExit(command=f"while [ ! -e {flag} ]; do sleep 0.02; done"), SystemEvent("old text")
        )
        await wait_until(lambda: engine.watchers.watched_pid(job.id) is not None)
        pid = engine.watchers.watched_pid(job.id)
        await engine.cron.update(job.id, payload=SystemEvent("new text"), name="renamed")
        assert engine.watchers.watched_pid(job.id) == pid
        flag.touch()
        (event,) = await wait_events(engine, 1)
    assert event.text.startswith("new text\n")
    assert event.job_name == "renamed"


@pytest.mark.serial
@pytest.mark.parametrize("how", ["disable", "remove", "cancel"])
async def test_exit_watcher_disable_or_remove_ends_command_without_fire(tmp_path: Path, how: str) -> None:
    async with engine_with(tmp_path / "s") as engine:
        job = await engine.cron.add(OnExit(command=f"trap '' INT; sleep {mark('336.1')}"), SystemEvent("x"))
        await wait_until(lambda: bool(pgrep(rf"^sleep 336\.1{SESSION}")))
        if how == "disable":
            await engine.cron.disable(job.id)
        elif how == "remove":
            await engine.cron.remove(job.id)
        else:
            await engine.watchers.cancel(job.id)
        assert engine.watchers.active_job_ids() == []
        with trio.fail_after(6):
            while pgrep(rf"^sleep 336\.1{SESSION}"):
                await trio.sleep(0.05)
        await trio.sleep(0.3)
        assert await engine.cron.events() == []


async def test_exit_watcher_job_is_not_run_now_which_would_fire_it_twice(tmp_path: Path) -> None:
    """Found by a new user: ``cron run`` of an on-exit job fired it at once, while its command ran, and
    again when the command exited."""
    marker = mark("336.4")
    try:
        async with engine_with(tmp_path / "s") as engine:
            job = await engine.cron.add(OnExit(command=f"sleep {marker}"), SystemEvent("x"))
            await wait_until(lambda: engine.watchers.watched_pid(job.id) is not None)
            with pytest.raises(
                InvalidArgumentError, match="on-exit job: it fires once, when its command exits"
            ):
                await engine.cron.run_now(job.id)
            assert await engine.cron.events() == []
            assert engine.watchers.active_job_ids() == [job.id]  # its command still watched
            kill_pids(pgrep(rf"^sleep {marker}$"))
            [event] = await wait_events(engine, 1)
            assert event.job_id == job.id
            await trio.sleep(0.3)
            assert len(await engine.cron.events()) == 1
    finally:
        kill_leftovers(rf"^sleep {marker}$")


async def test_exit_watcher_graceful_stop_leaves_command_running_for_next_engine(tmp_path: Path) -> None:
    marker = mark("337.1")
    runs = tmp_path / "runs.txt"
    try:
        async with engine_with(tmp_path / "s") as engine:
            job = await engine.cron.add(
                OnExit(command=f"echo run >> {runs}; sleep {marker}"), SystemEvent("x")
            )
            await wait_until(lambda: engine.watchers.watched_pid(job.id) is not None)
            first = engine.watchers.watched_pid(job.id)
        # Left running, unsignalled; its watch state kept.
        await wait_until(lambda: len(pgrep(rf"^sleep {marker}$")) == 1)
        async with engine_with(tmp_path / "s") as engine:
            assert (await engine.cron.get(job.id)).enabled
            assert engine.watchers.watched_pid(job.id) == first  # adopted, not started again
            await trio.sleep(0.3)
            assert await engine.cron.events() == []
            kill_leftovers(rf"^sleep {marker}$")  # the command ends: the adopting engine fires it once
            (event,) = await wait_events(engine, 1)
        # bash ran its last command in its own process (exec): the command itself was killed
        assert (event.job_id, event.exit_code, event.signal, event.reason) == (job.id, None, 9, "signal")
        assert runs.read_text() == "run\n"
    finally:
        kill_leftovers(rf"^sleep {marker}$")


@pytest.mark.parametrize("how", ["error", "cancel"])
async def test_exit_watcher_leaving_the_engine_by_error_or_cancellation_leaves_the_command(
    tmp_path: Path, how: str
) -> None:
    marker = mark("337.4")
    try:
        raises = pytest.raises(ValueError) if how == "error" else contextlib.nullcontext()
        with trio.CancelScope() as outer, raises:
            async with engine_with(tmp_path / "s") as engine:
                job = await engine.cron.add(OnExit(command=f"sleep {marker}"), SystemEvent("x"))
                await wait_until(lambda: engine.watchers.watched_pid(job.id) is not None)
                pid = engine.watchers.watched_pid(job.id)
                if how == "error":
                    raise ValueError("the host failed")
                outer.cancel()
                await trio.sleep_forever()
        # Left running (bash may still be starting its sleep: the engine left an instant after the spawn).
        await wait_until(lambda: len(pgrep(rf"^sleep {marker}$")) == 1)
        async with engine_with(tmp_path / "s") as engine:
            assert engine.watchers.watched_pid(job.id) == pid
    finally:
        kill_leftovers(rf"^sleep {marker}$")


async def test_exit_watcher_command_ending_between_engines_fires_once(tmp_path: Path) -> None:
    flag = tmp_path / "go"
    async with engine_with(tmp_path / "s") as engine:
        job = await engine.cron.add(
            OnExit(command=f"while [ ! -e {flag} ]; do sleep 0.02; done; echo ended; exit 4"),
            SystemEvent("between"),
        )
        await wait_until(lambda: engine.watchers.watched_pid(job.id) is not None)
        pid = engine.watchers.watched_pid(job.id)
    flag.touch()  # it ends while no engine runs: the shim records the exit
    assert pid is not None
    await wait_until(lambda: not pgrep_env(COMMAND_VAR, str(flag)))
    async with engine_with(tmp_path / "s") as engine:
        (event,) = await wait_events(engine, 1)
        assert not (await engine.cron.get(job.id)).enabled
    assert (event.exit_code, event.reason, event.stdout_tail) == (4, "exit", "ended\n")
    assert not os.path.exists(f"/proc/{pid}")  # the host process reaped its own zombie


async def test_exit_watcher_cancel_all_ends_commands_and_fires_cancelled(tmp_path: Path) -> None:
    marker, adopted_marker, stubborn_marker = mark("337.2"), mark("337.3"), mark("337.4")
    missing = tmp_path / "later"
    missing.mkdir()
    try:
        async with engine_with(tmp_path / "s") as engine:
            earlier = await engine.cron.add(OnExit(command=f"sleep {adopted_marker}"), SystemEvent("a"))
            # adopted too, and deaf to SIGINT: the escalation's SIGKILL ends its shim as well (found by a
            # new user: it was reported lost, and did not fire)
            stubborn = await engine.cron.add(
                OnExit(command=f"trap '' INT; sleep {stubborn_marker}"), SystemEvent("d")
            )
            await wait_until(lambda: engine.watchers.watched_pid(earlier.id) is not None)
            await wait_until(lambda: engine.watchers.watched_pid(stubborn.id) is not None)
        async with engine_with(tmp_path / "s") as engine:  # adopts `earlier`, starts `job`
            job = await engine.cron.add(
                OnExit(command=f"echo started; trap 'exit 7' INT; sleep {marker} & wait"), SystemEvent("b")
            )
            waiting = await engine.cron.add(OnExit(command="true", cwd=str(missing)), SystemEvent("c"))
            missing.rmdir()  # `waiting` keeps failing to spawn, retried
            await wait_until(lambda: bool(pgrep(rf"^sleep {marker}$")))
            await wait_until(lambda: engine.watchers.last_error(waiting.id) is not None)
            assert engine.watchers.watched_pid(earlier.id) is not None
            with trio.fail_after(10):
                await engine.watchers.cancel_all()
            assert engine.watchers.active_job_ids() == []
            events = {e.job_id: e for e in await engine.cron.events()}
            jobs = {j.id: j for j in await engine.cron.list()}
        assert not pgrep(rf"^sleep ({marker}|{adopted_marker}|{stubborn_marker})$")
        assert set(events) == {earlier.id, job.id, waiting.id, stubborn.id}
        assert {e.reason for e in events.values()} == {"cancelled"}
        assert events[job.id].exit_code == 7 and events[job.id].stdout_tail == "started\n"
        assert events[earlier.id].signal == 2  # adopted: ended by the same escalation
        assert events[stubborn.id].signal == 9
        assert not [p.name for p in (tmp_path / "s" / "watch-logs").iterdir() if ".tmp." in p.name]
        assert (events[waiting.id].exit_code, events[waiting.id].signal) == (None, None)
        assert "did not run to an exit (reason: cancelled)" in events[waiting.id].text
        assert not any(j.enabled for j in jobs.values())
        missing.mkdir()
        async with engine_with(tmp_path / "s") as engine:  # nothing re-runs, nothing fires again
            await trio.sleep(0.3)
            assert engine.watchers.active_job_ids() == []
            assert len(await engine.cron.events()) == 4
    finally:
        kill_leftovers(rf"^sleep ({marker}|{adopted_marker}|{stubborn_marker})$")


@pytest.mark.parametrize("containment", ["cgroup", "process-group"])
async def test_exit_watcher_sigkilled_shim_leaves_no_temp_file_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, containment: str
) -> None:
    # Found by a new user: `stop --end-watched` of a command deaf to SIGINT left the shim's reserved
    # `<exit file>.tmp.<pid>` in watch-logs, and the warning sent them to a stderr log the SIGKILLed shim
    # never wrote to.
    marker = mark("368.1")
    caplog.set_level(logging.WARNING, logger="engine.cron")
    try:
        async with engine_with(tmp_path / "s", containment=containment, grace_seconds=0.2) as engine:
            job = await engine.cron.add(OnExit(command=f"trap '' INT; sleep {marker}"), SystemEvent("d"))
            await wait_until(lambda: bool(pgrep(rf"^sleep {marker}$")))
            logs = tmp_path / "s" / "watch-logs"
            assert [p.name for p in logs.iterdir() if ".exit.json.tmp." in p.name]  # the shim's reserve
            with trio.fail_after(10):
                await engine.watchers.cancel_all()
            (event,) = await engine.cron.events()
        assert (event.job_id, event.reason, event.signal) == (job.id, "cancelled", 9)
        assert sorted(p.name for p in logs.iterdir() if ".tmp." in p.name) == []
        (said,) = [r.getMessage() for r in caplog.records if job.id in r.getMessage()]
        assert "ended by SIGKILL with its shim" in said and "the shim says why" not in said
    finally:
        kill_leftovers(rf"^sleep {marker}$")


async def test_exit_watcher_failed_spawn_is_retried_and_fires_once(tmp_path: Path) -> None:
    missing = tmp_path / "later"
    missing.mkdir()
    async with engine_with(tmp_path / "s") as engine:
        job = await engine.cron.add(
            OnExit(command="echo made-it", cwd=str(missing)), SystemEvent("x"), enabled=False
        )
        missing.rmdir()  # the folder goes away after the job was added: the spawn fails, and is retried
        await engine.cron.enable(job.id)
        await wait_until(lambda: engine.watchers.last_error(job.id) is not None)
        error = engine.watchers.last_error(job.id)
        assert error is not None and "working directory" in error
        stored = await engine.cron.get(job.id)  # visible to `cron list` too
        assert stored.last_error == error and stored.enabled
        await trio.sleep(0.5)
        assert await engine.cron.events() == []
        missing.mkdir()
        (event,) = await wait_events(engine, 1)
    assert event.stdout_tail == "made-it\n"


async def test_exit_watcher_start_error_is_cleared_once_the_command_starts(tmp_path: Path) -> None:
    # Found by a new user: `cron get` showed the start error long after the command had started.
    missing, marker = tmp_path / "later", mark("441.1")
    missing.mkdir()
    try:
        async with engine_with(tmp_path / "s") as engine:
            job = await engine.cron.add(
                OnExit(command=f"sleep {marker}", cwd=str(missing)), SystemEvent("x"), enabled=False
            )
            missing.rmdir()
            await engine.cron.enable(job.id)
            await wait_until(lambda: engine.watchers.last_error(job.id) is not None)
            assert (await engine.cron.get(job.id)).last_error == engine.watchers.last_error(job.id)
            missing.mkdir()
            await wait_until(lambda: bool(pgrep(rf"^sleep {marker}$")))
            await wait_until(lambda: engine.watchers.last_error(job.id) is None)
            for _ in range(100):  # the store is cleared right after the in-memory error
                stored = await engine.cron.get(job.id)
                if stored.last_error is None:
                    break
                await trio.sleep(0.02)
            assert (stored.last_status, stored.last_error, stored.enabled) == (None, None, True)
            await engine.watchers.cancel_all()
    finally:
        kill_leftovers(rf"^sleep {marker}$")


async def test_a_removed_job_leaves_no_start_error_behind(tmp_path: Path) -> None:
    """A job removed while its command's start fails: the watchers keep nothing of it (its start error,
    the status that error replaced), while a disabled job keeps the status to put back."""
    missing = tmp_path / "later"
    missing.mkdir()
    async with engine_with(tmp_path / "s") as engine:
        jobs = [
            await engine.cron.add(OnExit(command="true", cwd=str(missing)), SystemEvent("x"), enabled=False)
            for _ in range(2)
        ]
        missing.rmdir()
        for job in jobs:
            await engine.cron.enable(job.id)
        await wait_until(lambda: all(engine.watchers.last_error(job.id) is not None for job in jobs))
        removed, disabled = jobs
        await engine.cron.disable(disabled.id)
        await engine.cron.remove(removed.id)
        assert engine.watchers.last_error(removed.id) is None
        assert removed.id not in engine.watchers._before_start_error
        assert disabled.id in engine.watchers._before_start_error
        assert engine.watchers.active_job_ids() == []
        assert await engine.cron.events() == []


# ---- CR-03: a failing store write never fires, the command never runs again --------------------


async def test_exit_watcher_cr03_store_failure_fails_closed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    d = tmp_path / "D"
    d.mkdir()
    store = FlakyStore(str(tmp_path / "s" / "cron.sqlite3"))
    caplog.set_level(logging.ERROR, logger="engine.cron")
    async with engine_with(tmp_path / "s", store=store, watch_retry_seconds=(0.5,)) as engine:
        job = await engine.cron.add(
            OnExit(command="echo run >> runs.txt; echo done", cwd=str(d)), SystemEvent("J")
        )
        store.failing.add(job.id)
        other = await engine.cron.add(OnExit(command="echo other", cwd=str(d)), SystemEvent("other"))
        (other_event,) = await wait_events(engine, 1)  # other jobs keep firing
        assert other_event.job_id == other.id
        await wait_until(lambda: (d / "runs.txt").exists())
        await trio.sleep(3.0)
        assert [e.job_id for e in await engine.cron.events()] == [other.id]  # no fire while failing
        error = engine.watchers.last_error(job.id)
        assert error is not None and "persisting the exit failed" in error
        assert any(job.id in r.getMessage() for r in caplog.records)
        await trio.sleep(2.0)
        assert (d / "runs.txt").read_text() == "run\n"  # no retry storm: the command never re-ran
        assert store.commit_attempts < 20
        store.failing.clear()
        events = await wait_events(engine, 2)
        await trio.sleep(1.0)
        events = await engine.cron.events()
    assert [e.job_id for e in events] == [other.id, job.id]
    assert events[1].stdout_tail == "done\n"
    assert (d / "runs.txt").read_text() == "run\n"


async def test_exit_watcher_runs_no_command_before_its_arm_is_stored(tmp_path: Path) -> None:
    """Fail-closed before the spawn too: the arm is stored first (after a crash the next engine learns
    from it that the command may have run); while the store refuses it, the command does not run, the
    job's error says why, and the start is retried."""
    d = tmp_path / "D"
    d.mkdir()
    store = FlakyStore(str(tmp_path / "s" / "cron.sqlite3"))
    store.failing_states = True
    async with engine_with(tmp_path / "s", store=store, watch_retry_seconds=(0.3,)) as engine:
        job = await engine.cron.add(
            OnExit(command="echo run >> runs.txt; echo done", cwd=str(d)), SystemEvent("J")
        )
        await wait_until(lambda: engine.watchers.last_error(job.id) is not None)
        error = engine.watchers.last_error(job.id)
        assert error is not None and "storing the arm before the start failed" in error
        assert "No space left on device" in error
        await trio.sleep(1.0)  # three more attempts
        assert not (d / "runs.txt").exists()
        assert (await engine.cron.get(job.id)).enabled
        store.failing_states = False
        (event,) = await wait_events(engine, 1)
        assert engine.watchers.last_error(job.id) is None
    assert event.stdout_tail == "done\n"
    assert (d / "runs.txt").read_text() == "run\n"


async def test_exit_watcher_store_failure_then_rearm_drops_old_exit(tmp_path: Path) -> None:
    store = FlakyStore(str(tmp_path / "s" / "cron.sqlite3"))
    async with engine_with(tmp_path / "s", store=store) as engine:
        job = await engine.cron.add(OnExit(command="echo gen-1; exit 1"), SystemEvent("J"))
        store.failing.add(job.id)
        await wait_until(lambda: engine.watchers.last_error(job.id) is not None)
        store.failing.clear()
        current = await engine.cron.get(job.id)
        await engine.watchers.reconcile(
            [attrs.evolve(current, schedule=OnExit(command="echo gen-2; exit 2"))]
        )
        events = await wait_events(engine, 1)
        await trio.sleep(0.8)
        events = await engine.cron.events()
    assert len(events) == 1
    assert events[0].exit_code in (1, 2)  # one generation, never both
    if events[0].exit_code == 2:
        assert events[0].stdout_tail == "gen-2\n"


@pytest.fixture(autouse=True)
def _no_leftovers(tmp_path: Path) -> object:
    yield None
    end_left_commands(tmp_path)  # a graceful stop left them running, as children of this process
    kill_leftovers(rf"sleep 33[5-7]\.1{SESSION}")
    kill_pids(pgrep_env(COMMAND_VAR, "echo gen-"))
    assert os.getpid() > 0


# ---- the wall clock is the engine's (EngineConfig.wall_clock), never read directly ---------------


async def test_exit_watcher_uses_the_engine_wall_clock(tmp_path: Path) -> None:
    wall = datetime(2031, 1, 2, 3, 4, 5, tzinfo=UTC)
    missing = tmp_path / "later"
    async with engine_with(tmp_path / "s", wall_clock=lambda: wall) as engine:
        failing = await engine.cron.add(
            OnExit(command="true", cwd=str(tmp_path)), SystemEvent("x"), enabled=False
        )
        missing.mkdir()
        job = await engine.cron.add(
            OnExit(command="exit 4", cwd=str(missing)), SystemEvent("y"), enabled=False
        )
        missing.rmdir()  # its spawn fails: the error is stored with the engine's time
        await engine.cron.enable(job.id)
        await wait_until(lambda: engine.watchers.last_error(job.id) is not None)
        assert (await engine.cron.get(job.id)).updated_at == wall
        await engine.cron.enable(failing.id)
        await wait_events(engine, 1)
        done = await engine.cron.get(failing.id)
        await engine.cron.remove(job.id)
    assert done.last_run_at == wall and done.updated_at == wall and not done.enabled


async def test_an_exit_watchers_duration_is_the_commands_not_its_leftovers(tmp_path: Path) -> None:
    """A command that leaves a daemon behind and exits at once fired "after 10.0 s": the time the run
    took to end the daemon too (a fresh tester). The duration is now the command's own (the shim's
    ``ended_at``); the fire still comes once the daemon is ended."""
    daemon = f"trap '' INT; sleep {mark('338.5')}"
    async with engine_with(tmp_path / "s", grace_seconds=1.5) as engine:
        t0 = trio.current_time()
        await engine.cron.add(OnExit(command=f'setsid bash -c "{daemon}" & exit 0'), SystemEvent("x"))
        (event,) = await wait_events(engine, 1)
        waited = trio.current_time() - t0
    assert not pgrep(rf"^sleep 338\.5{SESSION}")
    assert waited >= 1.5  # the daemon ignored SIGINT: ended after the grace period
    assert event.exit_code == 0 and event.duration_seconds is not None and event.duration_seconds < 1.0
