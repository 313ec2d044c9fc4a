"""The subprocess service: create, ps, summarize, kill, halt, logs, caps.

Also the cases SP-01, SP-02, SP-11, SP-14 and SP-15 of ``cases.md``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio

from engine import (
    InvalidArgumentError,
    LimitExceededError,
    Project,
    RunState,
    SpawnError,
    StdinClosedError,
    SubProcess,
    SubProcessNotFoundError,
    SubProcessService,
    TerminationReason,
)
from engine._logpair import LogPair

from .children import (
    SESSION,
    kill_leftovers,
    mark,
    open_fds,
    pgrep,
    proc_exists,
    wait_for_state,
    wait_for_text,
    wait_until,
)
from .service_support import engine_at, fds_pointing_at, log_dir, log_paths, make_project

EXAMPLES = Path(__file__).parent.parent / "docs" / "examples"


# ---- Project ---------------------------------------------------------------------------------------


def test_project_from_directory_is_stable_and_absolute(tmp_path: Path) -> None:
    (tmp_path / "My App").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "My App")
    a = Project.from_directory(tmp_path / "My App")
    b = Project.from_directory(str(tmp_path / "link"))
    assert a == b
    assert a.slug == "my-app"
    assert os.path.isabs(a.directory)
    assert a.scope_key == f"project:{a.id}"


def test_project_rejects_relative_or_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="absolute"):
        Project(id="x", slug="x", directory="relative/dir")
    with pytest.raises(ValueError, match="does not exist"):
        Project.from_directory(tmp_path / "missing")


# ---- create, ps, summarize ---------------------------------------------------------------------------


async def test_create_runs_in_project_directory_with_private_logs(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        sp = await engine.service.create(project, "bash", ["-c", "pwd; echo to-err >&2"])
        with trio.fail_after(10):
            result = await sp.wait()
        assert result.exit_code == 0
        folder = log_dir(project)
        assert sp.stdout_path == str(folder / f"subproc-{sp.pid}.stdout.log")
        assert sp.stderr_path == str(folder / f"subproc-{sp.pid}.stderr.log")
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        for path in log_paths(sp):
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        names = [".gitignore", *(os.path.basename(p) for p in log_paths(sp))]
        assert sorted(os.listdir(folder)) == sorted(names)
        assert await engine.service.get_log(sp.pid, "stdout") == project.directory + "\n"
        assert await engine.service.get_log(sp.pid, "stderr") == "to-err\n"


async def test_create_puts_child_in_project_scope(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        sp = await engine.service.create(project, "sleep", [mark("311.1")])
        assert [r.pid for r in engine.supervisor.runs(f"project:{project.id}")] == [sp.pid]
        assert engine.service.summarize(sp).state is RunState.RUNNING
    assert not pgrep(rf"sleep 311\.1{SESSION}")


async def test_ps_lists_live_and_kept_records_in_order(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        service = engine.service
        a = await service.create(project, "sleep", [mark("311.2")])
        b = await service.create(project, "true")
        c = await service.create(project, "sleep", [mark("311.3")])
        with trio.fail_after(10):
            await b.wait()
        await service.halt_subprocess(c)
        assert service.ps() == [a, b, c]
        assert [s.running for s in service.ps()] == [True, False, False]
        await service.kill_subprocess(b)
        assert service.ps() == [a, c]
        assert service.lookup(a.pid) is a


async def test_summarize_reports_status_from_process_and_serialises(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        sp = await engine.service.create(project, "sh", ["-c", "sleep 0.3; exit 4"])
        running = engine.service.summarize(sp)
        assert (running.state, running.status, running.exit_code, running.reason) == (
            RunState.RUNNING,
            "running",
            None,
            None,
        )
        with trio.fail_after(10):
            await sp.wait()
        done = engine.service.summarize(sp)
        assert (done.state, done.status, done.exit_code, done.signal) == (
            RunState.EXITED,
            "exited 4",
            4,
            None,
        )
        assert done.reason is TerminationReason.EXIT
        assert done.updated_at >= done.created_at
        data = json.loads(json.dumps(done.to_dict()))
        assert data["state"] == "exited"
        assert data["args"] == ["-c", "sleep 0.3; exit 4"]
        assert data["project_slug"] == project.slug
        assert data["created_at"] == done.created_at.isoformat()


async def test_summarize_updated_at_follows_log_mtime(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        sp = await engine.service.create(
            project, "bash", ["-c", f"sleep 1.2; echo late; sleep {mark('311.4')}"]
        )
        first = engine.service.summarize(sp).updated_at
        await wait_for_text(sp.stdout_path, "late")
        later = engine.service.summarize(sp).updated_at
        assert (later - first).total_seconds() >= 1.0
        await engine.service.kill_subprocess(sp)


async def test_create_rejects_bad_arguments_before_any_side_effect(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        for cmd, args in [("", []), ("echo", "not-a-list"), ("echo", [1]), ("echo", ["a\0b"])]:
            with pytest.raises((ValueError, TypeError)):
                await engine.service.create(project, cmd, args)  # type: ignore[arg-type]  # deliberately wrong
        assert engine.service.ps() == []
        assert not (Path(project.directory) / ".gadget").exists()


async def test_create_limits_name_the_setting_and_leave_nothing(tmp_path: Path) -> None:
    p1, p2 = make_project(tmp_path, "one"), make_project(tmp_path, "two")
    async with engine_at(tmp_path, max_processes_per_project=2, max_processes=3) as engine:
        service = engine.service
        await service.create(p1, "sleep", [mark("311.5")])
        await service.create(p1, "sleep", [mark("311.5")])
        with pytest.raises(LimitExceededError, match="max_processes_per_project"):
            await service.create(p1, "sleep", [mark("311.5")])
        await service.create(p2, "sleep", [mark("311.5")])
        with pytest.raises(LimitExceededError, match="max_processes "):
            await service.create(p2, "sleep", [mark("311.5")])
        assert len(service.ps()) == 3
        assert len(os.listdir(log_dir(p2))) == 3  # two logs and the .gitignore
        await service.halt_pid(service.ps()[0].pid)  # a halted process no longer counts
        await service.create(p1, "true")
    assert not pgrep(rf"sleep 311\.5{SESSION}")


# ---- kill and halt -------------------------------------------------------------------------------


async def test_kill_pid_removes_logs_and_record(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        sp = await engine.service.create(project, "bash", ["-c", f"echo hi; sleep {mark('312.1')}"])
        await wait_for_text(sp.stdout_path, "hi")
        assert await engine.service.kill_pid(sp.pid) is True
        assert not pgrep(rf"sleep 312\.1{SESSION}")
        assert not any(os.path.exists(p) for p in log_paths(sp))
        assert engine.service.ps() == []
        with pytest.raises(SubProcessNotFoundError):
            await engine.service.kill_pid(sp.pid)
        with pytest.raises(SubProcessNotFoundError):
            await engine.service.kill_subprocess(sp)


async def test_kill_pid_deletes_the_logs_while_the_tree_handles_sigint(tmp_path: Path) -> None:
    """``kill_pid`` sends SIGINT, then deletes both logs while the tree handles it (the unlinks overlap
    its exit instead of following it): the child's handler, run after SIGINT, finds its own stdout
    already unlinked."""
    project = make_project(tmp_path)
    seen = tmp_path / "stdout-seen-by-the-handler"
    own = ".gadget/subprocess-logs/subproc-$$.stdout.log"  # the cwd is the project's directory
    script = (
        f"trap 'sleep 0.3; test -e {own} && echo present > {seen} || echo gone > {seen}; exit 0' INT; "
        f"echo ready; while :; do sleep {mark('312.15')}; done"
    )
    async with engine_at(tmp_path, grace_seconds=10.0) as engine:
        sp = await engine.service.create(project, "bash", ["-c", script])
        await wait_for_text(sp.stdout_path, "ready")
        await wait_until(lambda: bool(pgrep(rf"^sleep 312\.15{SESSION}")))
        assert all(os.path.exists(p) for p in log_paths(sp))
        with trio.fail_after(9):  # within the grace: the handler ended the tree
            assert await engine.service.kill_pid(sp.pid) is True
        assert seen.read_text() == "gone\n"
        assert not any(os.path.exists(p) for p in log_paths(sp))
        assert engine.service.ps() == []


async def test_a_log_read_during_a_kill_says_the_process_is_being_killed(tmp_path: Path) -> None:
    """The logs go once the kill's SIGINT is sent: a read while the kill is under way (a SIGINT-ignoring
    process, through its grace period) says the process is being killed, not that its log was removed."""
    project = make_project(tmp_path)
    script = f"trap '' INT; echo ready; sleep {mark('312.17')}"
    async with engine_at(tmp_path, grace_seconds=1.0) as engine:
        sp = await engine.service.create(project, "bash", ["-c", script])
        await wait_for_text(sp.stdout_path, "ready")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.service.kill_pid, sp.pid)
            await wait_until(lambda: not os.path.exists(sp.stdout_path), interval=0.005)
            assert sp.exit is None  # still in its grace period
            with pytest.raises(SubProcessNotFoundError, match=f"subprocess {sp.pid} is being killed"):
                await engine.service.read_log(sp.pid, "stdout")
        assert engine.service.ps() == []


async def test_the_log_folders_stay_open_a_while_after_the_last_record_goes(tmp_path: Path) -> None:
    """The kill of the last record leaves the project's log folders (and the files made ahead in them)
    open, for the next create, until ``RELEASE_FOLDERS_AFTER_SECONDS`` have passed with no record; then
    the engine holds nothing in the project's directory."""
    from engine._subprocesses import RELEASE_FOLDERS_AFTER_SECONDS

    project = make_project(tmp_path)

    def held() -> list[str]:
        targets = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        return [t for t in targets if t.startswith(project.directory + os.sep)]

    async with engine_at(tmp_path) as engine:
        first = await engine.service.create(project, "sleep", [mark("312.18")])  # makes the folders
        sp = await engine.service.create(project, "sleep", [mark("312.18")])  # keeps them open
        assert await engine.service.kill_pid(first.pid) is True
        assert await engine.service.kill_pid(sp.pid) is True
        killed = time.monotonic()
        assert held()  # kept for the next create
        again = await engine.service.create(project, "sleep", [mark("312.18")])  # from the kept folders
        assert await engine.service.kill_pid(again.pid) is True
        await wait_until(lambda: not held())
        assert time.monotonic() - killed >= RELEASE_FOLDERS_AFTER_SECONDS - 0.05
        assert os.listdir(log_dir(project)) == [".gitignore"]


async def test_kill_pid_after_natural_exit_returns_false_and_removes_logs(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        sp = await engine.service.create(project, "echo", ["done"])
        with trio.fail_after(10):
            await sp.wait()
        assert await engine.service.kill_pid(sp.pid) is False
        assert not any(os.path.exists(p) for p in log_paths(sp))


async def test_kill_pid_unknown_raises_not_found(tmp_path: Path) -> None:
    async with engine_at(tmp_path) as engine:
        with pytest.raises(SubProcessNotFoundError, match="999999"):
            await engine.service.kill_pid(999999)
        with pytest.raises(SubProcessNotFoundError):
            await engine.service.halt_pid(999999)


@pytest.mark.parametrize("pid", ["12", None, 1.5, True])
async def test_a_pid_that_is_no_whole_number_is_an_invalid_argument_and_changes_nothing(
    tmp_path: Path, pid: object
) -> None:
    """As the tool and the RPC say for the same value (they said so; the library said "not found")."""
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        service = engine.service
        sp = await service.create(project, "sleep", ["30"])
        for call in (service.kill_pid, service.halt_pid):
            with pytest.raises(InvalidArgumentError, match="pid must be a whole number"):
                await call(pid)  # type: ignore[arg-type]  # the wrong type is the point
        with pytest.raises(InvalidArgumentError, match="pid must be a whole number"):
            await service.get_log(pid, "stdout")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match='stream must be "stdout" or "stderr"'):
            await service.read_log(sp.pid, "nope")
        assert sp.running and all(os.path.exists(p) for p in log_paths(sp))
        await service.kill_pid(sp.pid)


async def test_kill_all_kills_every_project_and_verifies(tmp_path: Path) -> None:
    p1, p2 = make_project(tmp_path, "one"), make_project(tmp_path, "two")
    async with engine_at(tmp_path) as engine:
        service = engine.service
        records = [
            await service.create(p1, "bash", ["-c", f"sleep {mark('312.2')} & wait"]),
            await service.create(p2, "sleep", [mark("312.3")]),
            await service.create(p2, "true"),
        ]
        await service.halt_subprocess(records[1])
        assert await service.kill_all() is True
        assert service.ps() == []
        assert not pgrep(rf"sleep 312\.[23]{SESSION}")
        assert os.listdir(log_dir(p1)) == [".gitignore"] and os.listdir(log_dir(p2)) == [".gitignore"]
        assert await service.kill_all() is True  # nothing left: still verified empty


async def test_kill_project_leaves_other_projects_running(tmp_path: Path) -> None:
    p1, p2 = make_project(tmp_path, "one"), make_project(tmp_path, "two")
    async with engine_at(tmp_path) as engine:
        service = engine.service
        await service.create(p1, "sleep", [mark("312.4")])
        await service.create(p1, "sleep", [mark("312.4")])
        other = await service.create(p2, "sleep", [mark("312.5")])
        await service.kill_project(p1.id)
        assert not pgrep(rf"sleep 312\.4{SESSION}")
        assert service.ps() == [other] and other.running
        assert len(pgrep(rf"sleep 312\.5{SESSION}")) == 1
        await service.kill_project("no-such-project")
        assert service.ps() == [other]
    assert not pgrep(rf"sleep 312\.5{SESSION}")


@pytest.mark.serial
async def test_halt_pid_keeps_logs_and_record_then_second_halt_is_noop(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        service = engine.service
        sp = await service.create(project, "bash", ["-c", f"echo kept; sleep {mark('312.6')}"])
        await wait_for_text(sp.stdout_path, "kept")
        assert await service.halt_pid(sp.pid) is True
        assert not pgrep(rf"sleep 312\.6{SESSION}")
        assert service.ps() == [sp]
        assert service.summarize(sp).state is RunState.EXITED
        assert service.summarize(sp).reason is TerminationReason.CANCELLED
        assert await service.get_log(sp.pid, "stdout") == "kept\n"
        started = time.monotonic()
        assert await service.halt_pid(sp.pid) is False  # documented no-op: nothing is signalled
        assert await service.halt_subprocess(sp) is False
        assert time.monotonic() - started < 0.2
        assert await service.get_log(sp.pid, "stdout") == "kept\n"
        assert await service.kill_pid(sp.pid) is False
        assert not any(os.path.exists(p) for p in log_paths(sp))


async def test_halt_meeting_a_kill_says_the_logs_are_deleted(tmp_path: Path) -> None:
    """A halt that a kill overtakes does not answer as if the logs were kept (found by a new user)."""
    project = make_project(tmp_path)
    async with engine_at(tmp_path, grace_seconds=0.5) as engine:
        service = engine.service
        code = f"trap '' INT; echo up; sleep {mark('312.7')}"
        for first in ("halt", "kill", "kill_all"):
            sp = await service.create(project, "bash", ["-c", code])
            await wait_for_text(sp.stdout_path, "up")
            outcome: dict[str, object] = {}

            async def halt(sp: SubProcess = sp, outcome: dict[str, object] = outcome) -> None:
                try:
                    outcome["halt"] = await service.halt_subprocess(sp)
                except SubProcessNotFoundError as exc:
                    outcome["halt"] = exc

            async def kill(sp: SubProcess = sp, outcome: dict[str, object] = outcome) -> None:
                outcome["kill"] = await service.kill_subprocess(sp)

            async def kill_all(outcome: dict[str, object] = outcome) -> None:
                outcome["kill"] = await service.kill_all()  # True: verified, every tree ended

            with trio.fail_after(20):
                async with trio.open_nursery() as nursery:
                    starts: dict[str, Callable[[], Awaitable[None]]] = {
                        "halt": halt,
                        "kill": kill,
                        "kill_all": kill_all,
                    }
                    nursery.start_soon(starts[first])
                    await trio.sleep(0.1)  # the first is in its grace period
                    nursery.start_soon(kill if first == "halt" else halt)
            assert isinstance(outcome["halt"], SubProcessNotFoundError), outcome
            assert "its logs are deleted" in str(outcome["halt"])
            assert outcome["kill"] is (first != "halt")
            assert sp not in service.ps()
            assert not any(os.path.exists(p) for p in log_paths(sp))
    assert not pgrep(rf"sleep 312\.7{SESSION}")


async def test_create_moves_kept_logs_aside_when_pid_names_collide(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        service = engine.service
        old = await service.create(project, "echo", ["old-output"])
        with trio.fail_after(10):
            await old.wait()
        folder = str(log_dir(project))
        # The kernel handing ``old.pid`` to a new child is what triggers this step; take it directly.
        kept = [sp._logs for sp in service.ps()]
        new = LogPair.create(folder)
        new.rename(old.pid, kept)
        assert new.paths == (
            os.path.join(folder, f"subproc-{old.pid}.stdout.log"),
            os.path.join(folder, f"subproc-{old.pid}.stderr.log"),
        )
        assert old.stdout_path == os.path.join(folder, f"subproc-{old.pid}-1.stdout.log")
        assert await service.get_log(old.pid, "stdout") == "old-output\n"
        newer = LogPair.create(folder)
        newer.rename(old.pid, [*kept, new])  # a third holder: the second moves to the next free number
        assert new.path("stdout").endswith(f"subproc-{old.pid}-2.stdout.log")
        assert old.stdout_path.endswith("-1.stdout.log")
        for pair in (new, newer):
            pair.delete()


@pytest.mark.serial  # a time bound: measured alone (make test runs the rest two at a time)
async def test_create_failure_after_the_spawn_kills_the_child_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = make_project(tmp_path)
    spawned: list[int] = []

    def full_disk(self: LogPair, pid: int, others: object = ()) -> None:
        spawned.append(pid)
        raise OSError(errno.ENOSPC, "no space left on device")

    async with engine_at(tmp_path, grace_seconds=5.0) as engine:
        fds = open_fds()
        monkeypatch.setattr(LogPair, "rename", full_disk)
        t0 = time.monotonic()
        with pytest.raises(OSError, match="no space left"):
            await engine.service.create(project, "bash", ["-c", f"trap '' INT; sleep {mark('340.1')}"])
        assert time.monotonic() - t0 < 2.0  # killed at once, not after the 5 s grace
        (pid,) = spawned
        assert not proc_exists(pid)
        assert engine.service.ps() == [] and engine.supervisor.runs() == []
        assert not (Path(project.directory) / ".gadget").exists()  # files and the folders made
        assert open_fds() == fds
        monkeypatch.undo()
        sp = await engine.service.create(project, "echo", ["after"])  # nothing counts against limits
        with trio.fail_after(10):
            await sp.wait()
    assert not pgrep(rf"sleep 340\.1{SESSION}")


async def _create_with_pid(
    service: SubProcessService, project: Project, argv: tuple[str, ...], pid: int
) -> SubProcess:
    """Create a child that gets ``pid`` (the kernel hands out ``ns_last_pid + 1`` next)."""
    for _ in range(50):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        sp = await service.create(project, argv[0], argv[1:])
        if sp.pid == pid:
            return sp
        await service.kill_subprocess(sp)  # another process of the machine took it first
    pytest.skip(f"pid {pid} kept being taken by other processes")


async def test_pid_reused_moves_kept_logs_aside_and_each_project_reads_its_own(tmp_path: Path) -> None:
    if not os.access("/proc/sys/kernel/ns_last_pid", os.W_OK):
        pytest.skip("choosing the next pid needs CAP_SYS_ADMIN")
    a, b = make_project(tmp_path, "a"), make_project(tmp_path, "b")
    async with engine_at(tmp_path) as engine:
        service = engine.service
        old = await service.create(a, "echo", ["old-output"])
        with trio.fail_after(10):
            await old.wait()
        pid = old.pid
        same = await _create_with_pid(
            service, a, ("bash", "-c", f"echo same-project; sleep {mark('340.2')}"), pid
        )
        folder = log_dir(a)
        assert old.stdout_path == str(folder / f"subproc-{pid}-1.stdout.log")
        assert same.stdout_path == str(folder / f"subproc-{pid}.stdout.log")
        await wait_for_text(same.stdout_path, "same-project")
        assert service.lookup(pid) is same  # the live child wins
        assert await service.get_log(pid, "stdout") == "same-project\n"
        await service.halt_subprocess(same)
        other = await _create_with_pid(
            service, b, ("bash", "-c", f"echo other-project; sleep {mark('340.3')}"), pid
        )
        await wait_for_text(other.stdout_path, "other-project")
        assert service.lookup(pid) is other
        assert service.lookup(pid, project_id=a.id) is same  # project a's newest record
        mine = await service.read_log(pid, "stdout", project_id=a.id)
        assert mine.text == "same-project\n"
        text = await engine.tool.execute({"cmd": "log", "pid": pid, "which": "stdout"}, a)
        assert "same-project" in text and "other-project" not in text
        with pytest.raises(SubProcessNotFoundError, match="of project 'nope'"):
            await service.read_log(pid, "stdout", project_id="nope")
        assert await service.get_log(pid, "stdout") == "other-project\n"
    assert not pgrep(rf"sleep 340\.[23]{SESSION}")


# ---- logs ------------------------------------------------------------------------------------------


async def test_get_log_whole_content_and_errors(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        sp = await engine.service.create(project, "printf", ["a\\nb\\n\\377end"])
        with trio.fail_after(10):
            await sp.wait()
        assert await engine.service.get_log(sp.pid, "stdout") == "a\nb\n\ufffdend"
        assert await engine.service.get_log(sp.pid, "stderr") == ""
        with pytest.raises(ValueError, match='"stdout" or "stderr"'):
            await engine.service.get_log(sp.pid, "both")
        with pytest.raises(SubProcessNotFoundError):
            await engine.service.get_log(4242424, "stdout")
        os.unlink(sp.stdout_path)
        with pytest.raises(SubProcessNotFoundError, match="gone"):
            await engine.service.get_log(sp.pid, "stdout")


async def test_read_log_pages_by_offset_and_tail(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        sp = await engine.service.create(project, "seq", ["1", "1000"])
        with trio.fail_after(10):
            await sp.wait()
        service = engine.service
        last = await service.read_log(sp.pid, "stdout", tail=2)
        assert last.text == "999\n1000\n"
        assert (last.total_lines, last.dropped_bytes, last.truncated) == (1000, 0, True)
        page = await service.read_log(sp.pid, "stdout", offset=0, limit=3)
        assert page.text == "1\n2\n3\n"
        nxt = await service.read_log(sp.pid, "stdout", offset=page.next_offset, limit=1)
        assert nxt.text == "4\n"
        capped = await service.read_log(sp.pid, "stdout", max_bytes=5)
        assert capped.text == "1\n2\n3" and capped.next_offset == 5
        for bad in [{"offset": -1}, {"tail": 0}, {"tail": 2, "offset": 0}, {"max_bytes": 0}, {"limit": True}]:
            with pytest.raises((ValueError, TypeError)):
                await service.read_log(sp.pid, "stdout", **bad)  # type: ignore[arg-type]  # deliberately wrong


# ---- SP-01: a process that ignores SIGINT still dies within the budget (the 5 s default grace) -------

# {k} numbers the operation and {s} is the session's digits: `sleep 301.11<SESSION>` and so on.
_SP01_INPUTS = {
    1: ("bash", "-c", "trap '' INT; echo ready; sleep 301.1{k}{s}"),
    2: (
        "python3",
        "-c",
        "import signal,time; signal.signal(signal.SIGINT, signal.SIG_IGN); print('ready', flush=True); "
        "time.sleep(301.2{k}{s})",
    ),
    3: (
        "python3",
        "-c",
        "import os,signal,time; print('ready', flush=True); os.kill(os.getpid(), signal.SIGSTOP); "
        "time.sleep(301.3{k}{s})",
    ),
}


@pytest.mark.serial
async def test_kill_and_halt_end_sigint_ignoring_and_stopped_processes_within_budget(tmp_path: Path) -> None:
    """SP-01, inputs 1-3, each through kill_subprocess, kill_pid, halt_pid and the tool, concurrently."""
    project = make_project(tmp_path)
    try:
        async with engine_at(tmp_path, grace_seconds=5.0) as engine:
            service, tool = engine.service, engine.tool
            bystander = await service.create(project, "sleep", [mark("301.99")])
            ops: dict[str, Callable[[SubProcess], Awaitable[object]]] = {
                "kill_subprocess": service.kill_subprocess,
                "kill_pid": lambda sp: service.kill_pid(sp.pid),
                "halt_pid": lambda sp: service.halt_pid(sp.pid),
                "tool": lambda sp: tool.execute({"cmd": "kill", "pid": sp.pid}, project),
            }
            cases: list[tuple[int, int, str, SubProcess]] = []
            for case, argv in _SP01_INPUTS.items():
                for k, op in enumerate(ops, start=1):
                    sp = await service.create(project, argv[0], [a.format(k=k, s=SESSION) for a in argv[1:]])
                    cases.append((case, k, op, sp))
            for case, _k, _op, sp in cases:
                await wait_for_text(sp.stdout_path, "ready")
                if case == 3:
                    await wait_for_state(sp.pid, "T")
                assert service.summarize(sp).state is RunState.RUNNING  # stopped is still running
            timings: dict[tuple[int, str], float] = {}

            async def end(case: int, k: int, op: str, sp: SubProcess) -> None:
                t0 = time.monotonic()
                outcome = await ops[op](sp)
                t1 = time.monotonic()
                timings[case, op] = t1 - t0
                # right after the call, no extra sleep: gone, reaped, nothing left
                assert not pgrep(rf"301\.{case}{k}{SESSION}"), (case, op)
                assert not proc_exists(sp.pid), (case, op)
                if op == "tool":
                    assert outcome == f"SUBPROCESS KILLED\npid: {sp.pid}"
                else:
                    assert outcome is True
                summary = service.summarize(sp)
                assert summary.state is RunState.EXITED
                assert summary.exit_code != 0 or summary.signal is not None
                if case in (1, 2):
                    assert summary.signal == signal.SIGKILL, (case, op, summary)
                    assert summary.escalated
                if op == "halt_pid":
                    assert all(os.path.exists(p) for p in log_paths(sp))
                    assert "ready\n" in Path(sp.stdout_path).read_text()
                else:
                    assert not any(os.path.exists(p) for p in log_paths(sp))

            with trio.fail_after(30):
                async with trio.open_nursery() as nursery:
                    for item in cases:
                        nursery.start_soon(end, *item)
            print("SP-01 timings (s):", {f"{c}/{o}": round(t, 2) for (c, o), t in sorted(timings.items())})
            assert max(timings.values()) <= 6.0, timings
            assert all(timings[c, o] >= 4.9 for c in (1, 2) for o in ops)  # the grace was honoured
            assert bystander.running and len(pgrep(rf"sleep 301\.99{SESSION}")) == 1
    finally:
        kill_leftovers(rf"301\.[1-3][1-4]{SESSION}|301\.99{SESSION}")


# ---- SP-02: grandchildren, pipelines, nested shells, setsid escapees ---------------------------------

_SP02 = {
    "a": ("bash", "-c", f"sleep {mark('302.1')} & sleep {mark('302.2')} & wait"),
    "c": ("bash", "-c", f"bash -c 'sleep {mark('302.4')}; echo never' & wait"),
    "d": (
        "bash",
        "-c",
        f"setsid sleep {mark('302.5')} </dev/null >/dev/null 2>&1 & "
        f"setsid sh -c 'exec sleep {mark('302.6')}' & echo spawned; wait",
    ),
}


@pytest.mark.serial
@pytest.mark.parametrize("how", ["kill_subprocess", "kill_project", "kill_all"])
async def test_kill_ends_background_jobs_nested_shells_and_setsid_escapees(tmp_path: Path, how: str) -> None:
    """SP-02 (a), (c), (d) with a short grace; the bound is the 6 s of the default budget."""
    project = make_project(tmp_path)
    try:
        async with engine_at(tmp_path) as engine:
            service = engine.service
            records = [await service.create(project, argv[0], argv[1:]) for argv in _SP02.values()]
            await wait_until(lambda: len(pgrep(rf"^sleep 302\.[12456]{SESSION}")) >= 5)
            assert len(pgrep(rf"^sleep 302\.[12456]{SESSION}")) == 5  # the sleeps themselves, not the shells
            t0 = time.monotonic()
            if how == "kill_subprocess":
                async with trio.open_nursery() as nursery:
                    for sp in records:
                        nursery.start_soon(service.kill_subprocess, sp)
            elif how == "kill_project":
                await service.kill_project(project.id)
            else:
                assert await service.kill_all() is True
            elapsed = time.monotonic() - t0
            assert elapsed <= 6.0
            assert not pgrep(rf"sleep 302\.[12456]{SESSION}")
            ps_out = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout
            assert not re.search(rf"302\.[0-9]{SESSION}", ps_out)
            assert all(not sp.exit.survivors for sp in records if sp.exit is not None)
            assert service.ps() == []  # the engine is alive and answers
    finally:
        kill_leftovers(rf"sleep 302\.[0-9]{SESSION}")


@pytest.mark.serial
async def test_kill_pipeline_returns_fast_with_default_grace(tmp_path: Path) -> None:
    """SP-02 (b): both ends of the pipeline die on SIGINT, so even the 5 s grace is not waited out."""
    project = make_project(tmp_path)
    async with engine_at(tmp_path, grace_seconds=5.0) as engine:
        sp = await engine.service.create(project, "bash", ["-c", f"yes {mark('302.3')} | cat > /dev/null"])
        await wait_until(lambda: bool(pgrep(rf"yes 302\.3{SESSION}")))
        t0 = time.monotonic()
        assert await engine.service.kill_subprocess(sp) is True
        assert time.monotonic() - t0 <= 1.5
        assert not pgrep(rf"yes 302\.3{SESSION}")


# ---- SP-11: spawn failures ------------------------------------------------------------------------


@pytest.mark.serial
async def test_create_spawn_failures_name_cause_and_leave_nothing(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    root = Path(project.directory)
    (root / "script.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "script.sh").chmod(0o644)
    (root / "subdir").mkdir()
    (root / "bad-interp.sh").write_text("#!/nonexistent/interpreter\necho hi\n")
    (root / "bad-interp.sh").chmod(0o755)
    expected = {
        "definitely-not-a-command-308": ["not found", "definitely-not-a-command-308"],
        "./script.sh": ["permission denied", "./script.sh"],
        "./subdir": ["permission denied", "directory"],
        "./bad-interp.sh": ["./bad-interp.sh", "/nonexistent/interpreter"],
    }
    async with engine_at(tmp_path) as engine:
        fds = open_fds()
        zombies = set(_zombie_children())  # an earlier test's, not this one's
        for command, words in expected.items():
            t0 = time.monotonic()
            with pytest.raises(SpawnError) as info:
                await engine.service.create(project, command)
            assert time.monotonic() - t0 < 1.0
            message = str(info.value)
            for word in words:
                assert word in message, (command, message)
            assert "working directory" not in message
            text = await engine.tool.execute({"cmd": "create", "command": command}, project)
            assert text.startswith("SUBPROCESS ERROR: ") and words[0] in text
        assert engine.service.ps() == []
        assert not (root / ".gadget").exists()  # the folders made for the attempts went too
        assert open_fds() == fds
        assert set(_zombie_children()) <= zombies
        control = await engine.service.create(project, "sh", ["-c", "exit 127"])
        with trio.fail_after(10):
            await control.wait()
        assert engine.service.summarize(control).status == "exited 127"


async def test_create_with_a_path_of_its_own_names_that_path_when_the_command_is_not_in_it(
    tmp_path: Path,
) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        with pytest.raises(SpawnError, match=r"'true' is not in the PATH set for it \(/nonexistent-314\)"):
            await engine.service.create(project, "true", env={"PATH": "/nonexistent-314"})
        with pytest.raises(SpawnError, match=r"'no-such-command-314' is not in PATH; give a path"):
            await engine.service.create(project, "no-such-command-314")
        assert engine.service.ps() == []


async def test_create_with_an_environment_too_large_for_exec_says_so_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    project = make_project(tmp_path)
    zombies = set(_zombie_children())  # an earlier test's, not this one's
    async with engine_at(tmp_path) as engine:
        with pytest.raises(SpawnError) as info:  # one string over the kernel's 128 KiB per string
            await engine.service.create(project, "true", env={"BIG": "x" * 200_000})
        message = str(info.value)
        assert "argument list too long" in message and "file or stdin" in message, message
        assert info.value.errno == errno.E2BIG
        assert engine.service.ps() == []
        assert not (Path(project.directory) / ".gadget").exists()
        assert set(_zombie_children()) <= zombies


def _zombie_children() -> list[int]:
    """Pids of this process's children that are zombies."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                data = Path(f"/proc/{name}/stat").read_bytes()
            except OSError:
                continue
            fields = data[data.rfind(b")") + 2 :].split()
            if int(fields[1]) == os.getpid() and fields[0] == b"Z":
                found.append(int(name))
    return found


async def test_create_missing_project_directory_is_a_spawn_error(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    os.rmdir(project.directory)
    async with engine_at(tmp_path) as engine:
        with pytest.raises(SpawnError, match="does not exist"):
            await engine.service.create(project, "true")
    assert not os.path.exists(project.directory)


# ---- SP-14: halt, then read the logs ----------------------------------------------------------------


@pytest.mark.serial
async def test_halt_keeps_final_output_and_closes_logs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SP-14 (a) graceful shutdown with late output and (b) a block-buffered child, default grace."""
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)  # children inherit it: (b) must buffer
    project = make_project(tmp_path)
    graceful = (
        "import signal,sys,time\n"
        "def h(s,f):\n    print('cleanup-1', flush=True); time.sleep(0.5); print('cleanup-2'); sys.exit(0)\n"
        "signal.signal(signal.SIGINT, h)\n"
        "for i in range(3): print(f'tick {i}', flush=True)\n"
        f"time.sleep({mark('309.1')})"
    )
    buffered = f"import time; print('buffered-line'); time.sleep({mark('309.2')})"
    async with engine_at(tmp_path, grace_seconds=5.0) as engine:
        service = engine.service
        a = await service.create(project, "python3", ["-c", graceful])
        b = await service.create(project, "python3", ["-c", buffered])
        await wait_for_text(a.stdout_path, "tick 2")
        await trio.sleep(0.5)  # (b) printed by now, into its buffer: nothing to wait for but time
        assert service.summarize(b).status == "running"
        assert os.path.getsize(b.stdout_path) == 0
        for sp in (a, b):
            t0 = time.monotonic()
            assert await service.halt_pid(sp.pid) is True
            assert time.monotonic() - t0 <= 1.5
            assert not proc_exists(sp.pid)
        assert await service.get_log(a.pid, "stdout") == "tick 0\ntick 1\ntick 2\ncleanup-1\ncleanup-2\n"
        assert await service.get_log(b.pid, "stdout") == "buffered-line\n"
        assert (await service.get_log(b.pid, "stderr")).rstrip().endswith("KeyboardInterrupt")
        paths = log_paths(a) + log_paths(b)
        assert fds_pointing_at(paths) == []
        sizes = [os.path.getsize(p) for p in paths]
        summaries = {sp.pid: service.summarize(sp) for sp in service.ps()}
        assert (summaries[a.pid].state, summaries[a.pid].exit_code) == (RunState.EXITED, 0)
        assert (summaries[b.pid].state, summaries[b.pid].signal) == (RunState.EXITED, signal.SIGINT)
        await trio.sleep(2.0)
        assert [os.path.getsize(p) for p in paths] == sizes
        assert await service.halt_pid(a.pid) is False
        assert await service.get_log(a.pid, "stdout") == "tick 0\ntick 1\ntick 2\ncleanup-1\ncleanup-2\n"
        assert await service.kill_pid(a.pid) is False
        assert await service.kill_pid(b.pid) is False
        assert not any(os.path.exists(p) for p in paths)


# ---- SP-15: readable after a natural exit, a typed error after kill -----------------------------------


async def test_logs_readable_after_exit_and_typed_error_after_kill(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        service = engine.service
        a = await service.create(project, "bash", ["-c", "echo short-lived"])
        b = await service.create(project, "bash", ["-c", f"echo before-kill; sleep {mark('310.1')}"])
        with trio.fail_after(10):
            await a.wait()
        assert await service.get_log(a.pid, "stdout") == "short-lived\n"
        assert service.summarize(a).status == "exited 0"
        assert await service.kill_pid(b.pid) is True
        for stream in ("stdout", "stderr"):
            with pytest.raises(SubProcessNotFoundError, match=str(b.pid)):
                await service.get_log(b.pid, stream)
        with pytest.raises(ValueError, match='"stdout" or "stderr"'):
            await service.get_log(a.pid, "bogus")
        with pytest.raises(SubProcessNotFoundError):
            await service.get_log(999999, "stdout")
        assert not any(os.path.exists(p) for p in log_paths(b))
        text = await engine.tool.execute({"cmd": "log", "pid": b.pid, "which": "stdout"}, project)
        assert text.startswith("SUBPROCESS ERROR: ") and str(b.pid) in text


# ---- shutdown and the demo --------------------------------------------------------------------------


async def test_engine_shutdown_kills_all_and_removes_logs(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        service: SubProcessService = engine.service
        sp = await service.create(project, "bash", ["-c", f"sleep {mark('313.1')} & wait"])
        halted = await service.create(project, "sleep", [mark("313.2")])
        await service.halt_subprocess(halted)
    assert not pgrep(rf"sleep 313\.[12]{SESSION}")
    assert not any(os.path.exists(p) for p in log_paths(sp) + log_paths(halted))


@pytest.mark.machine_wide  # the demo looks for its server with a machine-wide `pgrep -f`
def test_service_demo_runs_and_leaves_nothing() -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "service_demo.py")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUBPROCESS CREATED" in proc.stdout
    assert "processes left: none" in proc.stdout


async def test_log_cap_task_runs_only_while_children_live(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        service = engine.service
        assert service._capper is None  # an idle engine does no work
        sp = await service.create(project, "sleep", ["0.2"])
        assert service._capper is not None
        with trio.fail_after(10):
            await sp.wait()
            while service._capper is not None:  # one last pass over the finished child, then it ends
                await trio.sleep(0.1)
        assert sp._capped_final


async def test_repr_caps_a_huge_argv_and_summarize_keeps_it(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    huge = "h" * (128 * 1024 - 1)
    async with engine_at(tmp_path) as engine:
        sp = await engine.service.create(project, "sh", ["-c", f"sleep {mark('340.96')}", huge])
        assert len(repr(sp)) < 300 and repr(sp).startswith(f"<SubProcess {sp.pid} project ['sh', '-c',")
        assert engine.service.summarize(sp).args == ("-c", f"sleep {mark('340.96')}", huge)
        text = await engine.tool.execute({"cmd": "list"}, project)
        assert len(text) < 300
        await engine.service.kill_subprocess(sp)


async def test_a_record_without_restart_or_notice_has_no_keeper_task(tmp_path: Path) -> None:
    """Its process's exit is followed by a hook of its run (``ManagedRun.on_leader_exit``): the record is
    finished, its stdin closed and the log cap woken, with no task per record."""
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        service = engine.service

        def keepers() -> list[str]:
            return [
                t.name
                for t in service._nursery.child_tasks
                if t.name.startswith("subprocess ") and t.name[11:].isdigit()
            ]

        plain = await service.create(project, "sh", ["-c", "read line; echo got $line"], stdin=True)
        assert keepers() == []
        await service.write_stdin(plain.pid, "x\n")
        with trio.fail_after(10):
            summary = await service.wait(plain.pid)
        assert plain.finished and summary.status == "exited 0"
        assert await service.get_log(plain.pid, "stdout") == "got x\n"
        with pytest.raises(StdinClosedError, match="exited"):
            await service.write_stdin(plain.pid, "late")
        noticed = await service.create(project, "sleep", ["0.1"], notify_on_exit=True)
        assert keepers() == [f"subprocess {noticed.first_pid}"]
        with trio.fail_after(10):
            await service.wait(noticed.pid)
