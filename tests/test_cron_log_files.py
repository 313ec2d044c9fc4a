"""Cron's log files and exit records in the state directory: what a command leaves at their paths (a
link, a FIFO, garbage) is never followed, waited on or trusted, and the engine says why it read nothing."""

from __future__ import annotations

import json
import os
import shutil
import stat
import uuid
from pathlib import Path

import pytest
import trio

from engine import Command, Every, OnExit, SpawnError, SpawnSpec, Supervisor, SystemEvent
from engine.cron._exit_record import read_exit_record
from engine.cron._log_files import remove_older_arms, remove_watch_entries

from .watch_support import engine_with, wait_events

SECRET = "secret-that-must-not-reach-the-agent"


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_text(SECRET + "\n")
    return victim


async def test_a_command_jobs_planted_log_link_and_fifo_are_replaced_not_followed(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    state = tmp_path / "s"
    async with engine_with(state) as engine:
        job = await engine.cron.add(
            Every(3600), Command(("sh", "-c", "echo out; echo err >&2"), cwd=str(tmp_path)), name="build"
        )
        logs = state / "cron-logs"
        logs.mkdir(mode=0o700, exist_ok=True)
        (logs / f"{job.id}.stdout.log").symlink_to(victim)  # an earlier run's command left these
        os.mkfifo(logs / f"{job.id}.stderr.log", 0o600)
        with trio.fail_after(10):  # opened O_WRONLY, the FIFO blocked the engine's loop for ever
            await engine.cron.run_now(job.id)
        (event,) = await wait_events(engine, 1)
    assert victim.read_text() == SECRET + "\n"  # neither truncated nor written through the link
    assert (event.stdout_tail, event.stderr_tail) == ("out\n", "err\n")
    for name in (f"{job.id}.stdout.log", f"{job.id}.stderr.log"):
        assert (logs / name).is_file() and not (logs / name).is_symlink()


async def test_a_watched_command_that_swaps_its_logs_and_record_still_fires_and_leaks_nothing(
    tmp_path: Path,
) -> None:
    victim = _victim(tmp_path)
    # The command finds its files from the shim's argv (its parent), replaces its stdout log with a link
    # to another file, its stderr log and its exit record with FIFOs, then kills the shim with SIGKILL.
    command = (
        "exit_file=$(tr '\\0' '\\n' < /proc/$PPID/cmdline | sed -n 2p); base=${exit_file%.exit.json}; "
        f'echo gone; rm -f "$base.stdout.log" "$base.stderr.log"; ln -s {victim} "$base.stdout.log"; '
        'mkfifo "$base.stderr.log" "$exit_file"; kill -KILL $PPID'
    )
    async with engine_with(tmp_path / "s") as engine:
        await engine.cron.add(OnExit(command=command, cwd=str(tmp_path)), SystemEvent("swapped"))
        (event,) = await wait_events(engine, 1)  # read as a FIFO, the record hung the fire for ever
        await engine.cron.get(event.job_id)
    assert SECRET not in event.text and event.stdout_tail == ""
    assert (event.exit_code, event.signal) == (None, 9)  # what the supervisor saw of the shim
    assert "--- stdout: not read: the log " in event.text and "is a symbolic link" in event.text
    assert "--- stderr: not read: the log " in event.text and "is a FIFO" in event.text


async def test_a_watch_log_folder_swapped_for_a_link_is_not_read(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    state = tmp_path / "s"
    logs = state / "watch-logs"
    gate = tmp_path / "gate"
    async with engine_with(state) as engine:
        job = await engine.cron.add(
            OnExit(command=f"echo before; while [ ! -e {gate} ]; do sleep 0.02; done; echo after"),
            SystemEvent("moved"),
        )
        with trio.fail_after(10):
            while not list(logs.glob(f"{job.id}.*.stdout.log")):
                await trio.sleep(0.02)
        # The folder moves away and a link to it takes its place while the command runs: its files are
        # still reached through the link by path, never by the engine.
        moved = elsewhere / "watch-logs"
        logs.rename(moved)
        logs.symlink_to(moved)
        gate.touch()
        (event,) = await wait_events(engine, 1)
    assert event.exit_code == 0 and event.stdout_tail == ""
    assert "--- stdout: not read: the folder of the log " in event.text
    assert "is a symbolic link, which the engine does not follow" in event.text


def test_read_exit_record_says_why_a_file_is_no_record(tmp_path: Path) -> None:
    folder = tmp_path / "watch-logs"
    folder.mkdir(mode=0o700)
    good = folder / "a.exit.json"
    good.write_text(json.dumps({"pid": 1, "exit_code": 3}))
    assert read_exit_record(str(good)).record == {"pid": 1, "exit_code": 3}
    assert read_exit_record(str(folder / "missing.exit.json")) == read_exit_record(str(tmp_path / "no/x"))
    assert read_exit_record(str(folder / "missing.exit.json")).problem is None
    garbage = folder / "g.exit.json"
    garbage.write_text("{not json")
    assert "is not a JSON object as the shim writes" in str(read_exit_record(str(garbage)).problem)
    (folder / "l.exit.json").symlink_to(good)
    assert "is a symbolic link" in str(read_exit_record(str(folder / "l.exit.json")).problem)
    os.mkfifo(folder / "f.exit.json", 0o600)
    with_fifo = read_exit_record(str(folder / "f.exit.json"))  # not waited on: no writer ever comes
    assert with_fifo.record is None and "is a FIFO" in str(with_fifo.problem)
    linked = tmp_path / "linked"
    linked.symlink_to(folder)
    through = read_exit_record(str(linked / "a.exit.json"))
    assert through.record is None and "the folder of the exit record" in str(through.problem)


async def test_a_garbage_exit_record_left_while_no_engine_ran_is_named_in_the_lost_message(
    tmp_path: Path,
) -> None:
    state = tmp_path / "s"
    gate = tmp_path / "gate"
    async with engine_with(state, kill_wait_seconds=0.5) as engine:
        job = await engine.cron.add(
            OnExit(command=f"while [ ! -e {gate} ]; do sleep 0.02; done"), SystemEvent("lost")
        )
        with trio.fail_after(10):
            while engine.watchers.watched_pid(job.id) is None:
                await trio.sleep(0.02)
        await trio.sleep(0.2)  # its watch state stored
    # Stopped gracefully: the command is left running for the next engine. It ends while none runs,
    # and its record is then turned into garbage.
    gate.touch()
    records = state / "watch-logs"
    with trio.fail_after(10):
        while not (found := list(records.glob(f"{job.id}.*.exit.json"))):
            await trio.sleep(0.02)
    found[0].write_text("garbage")
    async with engine_with(state) as engine:
        stored = await engine.cron.get(job.id)
    assert not stored.enabled and stored.last_error is not None
    assert (
        "watch lost across restart: the command's shim is not running and the exit record "
        in stored.last_error
    )
    assert "is not a JSON object as the shim writes" in stored.last_error


async def test_a_spawn_spec_output_path_at_a_fifo_with_no_reader_is_a_spawn_error(
    tmp_path: Path, supervisor: Supervisor
) -> None:
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo, 0o600)
    with trio.fail_after(5), pytest.raises(SpawnError, match="a FIFO no process reads"):
        await supervisor.spawn(SpawnSpec(argv=(shutil.which("true") or "true",), stdout=str(fifo)))


def _kept_bytes(path: Path) -> int:
    """What a log holds on disk: its blocks where a hole was punched, else its length."""
    info = path.stat()
    return min(info.st_size, info.st_blocks * 512)


CAP = 64 * 1024
#: Writes 2 MB, then its last line, then waits long enough for the cap's first look (1 s).
CHATTY = "head -c 2000000 /dev/zero | tr '\\0' z; echo; echo LAST-LINE; sleep 1.6"


async def test_a_watched_commands_logs_are_capped_while_it_runs_and_go_with_its_job(tmp_path: Path) -> None:
    logs = tmp_path / "s" / "watch-logs"
    async with engine_with(tmp_path / "s", log_cap_bytes=CAP) as engine:
        job = await engine.cron.add(OnExit(command=CHATTY), SystemEvent("chatty"))
        (event,) = await wait_events(engine, 1)
        (stdout,) = logs.glob(f"{job.id}.*.stdout.log")
        assert stdout.stat().st_size > 2_000_000  # the offsets stay: the oldest part is a hole, or cut
        assert _kept_bytes(stdout) <= CAP + 64 * 1024
        assert event.stdout_tail == "LAST-LINE\n"  # the 2 MB line before it is cut
        await engine.cron.remove(job.id)
        assert [p.name for p in logs.iterdir() if p.name.startswith(f"{job.id}.")] == []


async def test_a_command_jobs_logs_are_capped_after_it_ran_too(tmp_path: Path) -> None:
    """Written faster than the cap looks (here: before its first look), a log is trimmed once more when
    its command has ended (a tester's `timeout 10 yes` left 476 MB)."""
    async with engine_with(tmp_path / "s", log_cap_bytes=CAP) as engine:
        quick = CHATTY.removesuffix("; sleep 1.6")
        job = await engine.cron.add(Every(3600), Command(("sh", "-c", quick)), name="chatty")
        with trio.fail_after(20):
            await engine.cron.run_now(job.id)
        (event,) = await wait_events(engine, 1)
        stdout = tmp_path / "s" / "cron-logs" / f"{job.id}.stdout.log"
        assert _kept_bytes(stdout) <= CAP + 64 * 1024
        assert event.stdout_tail == "LAST-LINE\n"  # the 2 MB line before it is cut
        await engine.cron.remove(job.id)
        assert not stdout.exists()


async def test_what_a_command_puts_in_watch_logs_neither_stops_a_start_nor_outlives_its_job(
    tmp_path: Path,
) -> None:
    """A FIFO or a link at a log's name, a folder at its exit record's name: the start-up check refused
    the next start over them (each read is safe without it), and ``cron rm`` left the folder."""
    state = tmp_path / "s"
    logs = state / "watch-logs"
    plant = (
        "exit_file=$(tr '\\0' '\\n' < /proc/$PPID/cmdline | sed -n 2p); base=${exit_file%.exit.json}; "
        'rm -f "$base.stdout.log" "$base.stderr.log"; mkfifo "$base.stdout.log"; '
        'ln -s /etc/hostname "$base.stderr.log"; mkdir -p "$exit_file/inside"; exit 7'
    )
    async with engine_with(state) as engine:
        job = await engine.cron.add(OnExit(command=plant), SystemEvent("planted"))
        (event,) = await wait_events(engine, 1)
        assert event.exit_code == 7  # the record is a folder: what the supervisor saw
        assert "not read: the log " in event.text
        # The folder at the record's name went with the record; the FIFO and the link stay with the logs.
        assert sorted(stat.S_IFMT(p.lstat().st_mode) for p in logs.iterdir()) == sorted(
            [stat.S_IFLNK, stat.S_IFIFO]
        )
    async with engine_with(state) as engine:  # refused before: "... is a FIFO, not a regular file"
        await engine.cron.remove(job.id)
        assert [p.name for p in logs.iterdir() if p.name.startswith(f"{job.id}.")] == []


def test_older_arms_of_many_jobs_are_swept_in_one_look_and_the_kept_arms_stay(tmp_path: Path) -> None:
    folder = tmp_path / "watch-logs"
    folder.mkdir()
    names = {
        "j1.old.stdout.log": False, "j1.old.exit.json": False, "j1.new.stdout.log": True,
        "j1.new.started": True, "j1.newer.stdout.log": False,  # an arm id that only starts like the kept one
        "j2.any.stderr.log": False,  # the job's every arm goes (``None``)
        "j3.old.stdout.log": True,  # not a job of this sweep
        "j1": True, "j10.old.stdout.log": True,  # not an entry of j1
    }  # fmt: skip
    for name in names:
        (folder / name).write_text("x")
    (folder / "j2.any.exit.json").mkdir()  # what a command put at a name: removed with what it holds
    (folder / "j2.any.exit.json" / "inside").write_text("x")
    remove_older_arms(str(tmp_path), {"j1": "new", "j2": None})
    assert sorted(os.listdir(folder)) == sorted(name for name, kept in names.items() if kept)
    remove_watch_entries(str(tmp_path), "j1", but_arm=None)  # one job: the same sweep
    assert sorted(os.listdir(folder)) == ["j1", "j10.old.stdout.log", "j3.old.stdout.log"]


@pytest.mark.parametrize("planted", ["link", "fifo"])
async def test_what_is_planted_at_the_next_arms_start_mark_is_removed_not_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, planted: str
) -> None:
    """Found by a fresh tester: a link at ``<job>.<arm>.started`` had its target truncated by the shell's
    ``>``, a FIFO there blocked the command for good (the mark is made where a file of the user's runs
    first: ``BASH_ENV`` here)."""
    state, outside = tmp_path / "s", tmp_path / "outside.txt"
    outside.write_text("keep me\n")
    profile = tmp_path / "bash_env"
    profile.write_text("")
    monkeypatch.setenv("BASH_ENV", str(profile))
    arm = uuid.UUID("00000000-0000-4000-8000-00000000abcd")
    monkeypatch.setattr("uuid.uuid4", lambda: arm)  # the next arm's id (and the job's), known here
    async with engine_with(state) as engine:
        job = await engine.cron.add(OnExit(command="true"), SystemEvent("marked"), enabled=False)
        mark = state / "watch-logs" / f"{job.id}.{arm.hex[:12]}.started"
        mark.parent.mkdir(exist_ok=True)
        if planted == "link":
            mark.symlink_to(outside)
        else:
            os.mkfifo(mark)
        await engine.cron.enable(job.id)
        (event,) = await wait_events(engine, 1)
        assert (event.exit_code, event.reason) == (0, "exit")
    assert outside.read_text() == "keep me\n"
