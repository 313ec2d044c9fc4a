"""The supervisor: spawning, exits, scopes, replace-existing, max runtime and shutdown, with real children."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import trio
import trio.testing

from engine import (
    ManagedRun,
    RunState,
    SpawnError,
    SpawnSpec,
    Supervisor,
    TerminationReason,
    _procfs,
    open_supervisor,
)
from engine._containment import open_containment
from engine._errors import unwrap_single
from engine._procfs import is_child_subreaper

from .children import (
    SESSION,
    cooperative,
    mark,
    open_fds,
    pgrep,
    proc_exists,
    proc_state,
    py,
    wait_for_text,
    wait_until,
)


async def test_wait_reports_exit_code() -> None:
    async with open_supervisor(grace_seconds=0.3) as sup:
        run = await sup.spawn(SpawnSpec(argv=("sh", "-c", "exit 3")))
        with trio.fail_after(10):
            result = await run.wait()
    assert (result.exit_code, result.signal, result.reason) == (3, None, TerminationReason.EXIT)
    assert not result.escalated
    assert run.state is RunState.EXITED


async def test_wait_reports_death_by_signal_never_code_zero(supervisor: Supervisor) -> None:
    run = await supervisor.spawn(SpawnSpec(argv=py("import os,signal; os.kill(os.getpid(), signal.SIGSEGV)")))
    with trio.fail_after(10):
        result = await run.wait()
    assert result.signal == signal.SIGSEGV
    assert result.exit_code is None
    assert result.reason is TerminationReason.SIGNAL


async def test_wait_reports_exit_137_as_code_not_signal(supervisor: Supervisor) -> None:
    run = await supervisor.spawn(SpawnSpec(shell_command="exit 137"))
    with trio.fail_after(10):
        result = await run.wait()
    assert (result.exit_code, result.signal) == (137, None)


async def test_spawn_writes_both_streams_to_files(supervisor: Supervisor, tmp_path: Path) -> None:
    out, err = tmp_path / "out.log", tmp_path / "err.log"
    out.write_text("earlier\n")
    run = await supervisor.spawn(
        SpawnSpec(shell_command="echo to-out; echo to-err >&2", stdout=str(out), stderr=str(err))
    )
    with trio.fail_after(10):
        await run.wait()
    assert out.read_text() == "earlier\nto-out\n"  # O_APPEND: existing content kept
    assert err.read_text() == "to-err\n"
    assert os.stat(err).st_mode & 0o777 == 0o600


async def test_spawn_gives_child_a_clean_start(supervisor: Supervisor, tmp_path: Path) -> None:
    out = tmp_path / "out"
    # A shell, not Python: Python ignores SIGPIPE and SIGXFSZ itself at start-up.
    script = (
        "s=/proc/$$/status; echo ign $(sed -n 's/^SigIgn:[[:space:]]*//p' $s); "
        "echo blk $(sed -n 's/^SigBlk:[[:space:]]*//p' $s); "
        "echo stdin $(readlink /proc/$$/fd/0); echo fds $(ls /proc/$$/fd | sort -n | tr '\\n' ' '); "
        "echo pwd $PWD $(pwd -P); echo sid $(ps -o sid= -p $$) $(ps -o pgid= -p $$) $$; echo extra $EXTRA"
    )
    old = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        run = await supervisor.spawn(
            SpawnSpec(argv=("sh", "-c", script), cwd=str(tmp_path), env={"EXTRA": "yes"}, stdout=str(out))
        )
    finally:
        signal.signal(signal.SIGTERM, old)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    with trio.fail_after(10):
        assert (await run.wait()).exit_code == 0
    lines = dict(line.split(" ", 1) for line in out.read_text().splitlines())
    assert int(lines["ign"], 16) & ((1 << 31) - 1) == 0  # no standard signal ignored, SIGTERM included
    assert int(lines["blk"], 16) == 0
    assert lines["stdin"] == "/dev/null"
    assert lines["fds"].split() == ["0", "1", "2"] or lines["fds"].split()[:3] == ["0", "1", "2"]
    assert lines["pwd"] == f"{tmp_path} {os.path.realpath(tmp_path)}"
    sid, pgid, pid = lines["sid"].split()
    assert sid == pgid == pid == str(run.pid)
    assert lines["extra"] == "yes"


async def test_spawn_without_inherit_env_uses_only_given_env(supervisor: Supervisor, tmp_path: Path) -> None:
    out = tmp_path / "env"
    run = await supervisor.spawn(
        SpawnSpec(argv=("/usr/bin/env",), env={"ONLY": "1"}, inherit_env=False, stdout=str(out))
    )
    with trio.fail_after(10):
        await run.wait()
    names = {line.split("=", 1)[0] for line in out.read_text().splitlines()}
    assert names == {"ONLY", "PWD", "GADGET_ENGINE_RUN"}


@pytest.mark.serial
async def test_cancel_cooperative_child_is_fast_without_sigkill(tmp_path: Path) -> None:
    async with open_supervisor() as sup:  # the 5 s default grace: SIGINT alone must do it
        out = tmp_path / "out"
        run = await sup.spawn(SpawnSpec(argv=cooperative(mark("321.9")), stdout=str(out)))
        await wait_for_text(out, "ready")
        t0 = time.monotonic()
        result = await sup.cancel(run)
        elapsed = time.monotonic() - t0
    assert elapsed < 1.0
    assert not result.escalated
    assert (result.exit_code, result.reason) == (0, TerminationReason.CANCELLED)
    assert out.read_text() == "ready\nbye\n"


@pytest.mark.serial
async def test_cancel_with_force_goes_straight_to_sigkill() -> None:
    async with open_supervisor() as sup:
        run = await sup.spawn(SpawnSpec(argv=("sleep", mark("321.8"))))
        t0 = time.monotonic()
        result = await sup.cancel(run, force=True)
    assert time.monotonic() - t0 < 1.0
    assert result.signal == signal.SIGKILL
    assert result.escalated


async def test_cancel_of_exited_run_returns_same_exit(supervisor: Supervisor) -> None:
    run = await supervisor.spawn(SpawnSpec(argv=("true",)))
    with trio.fail_after(10):
        first = await run.wait()
    assert await supervisor.cancel(run) is first
    assert await supervisor.cancel(run, force=True) is first


async def test_cancel_twice_concurrently_escalates_once(supervisor: Supervisor) -> None:
    run = await supervisor.spawn(SpawnSpec(argv=("sleep", mark("321.7"))))
    exits = []

    async def stop() -> None:
        exits.append(await supervisor.cancel(run))

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stop)
            nursery.start_soon(stop)
    assert exits[0] is exits[1]
    assert not pgrep(rf"sleep 321\.7{SESSION}")


@pytest.mark.parametrize("watched", [False, True])
async def test_a_leader_dead_of_the_cancels_sigint_before_its_task_looked_ends_as_cancelled(
    supervisor: Supervisor, watched: bool
) -> None:
    """The first step of a cancel (the look and SIGINT) is taken in the caller's task (``begin_cancel``, and
    ``cancel`` itself): a leader that dies of that SIGINT before its run's task has looked, or even run
    (``watched=False``: no checkpoint since the spawn), still ends as a cancel, never as an exit of its own
    (``SIGNAL``)."""
    run = await supervisor.spawn(SpawnSpec(argv=("sleep", mark("321.55"))))
    if watched:
        await wait_until(lambda: bool(pgrep(rf"^sleep 321\.55{SESSION}")))
        await trio.sleep(0.05)  # its task waits on the leader
    supervisor.begin_cancel([run])
    deadline = time.monotonic() + 10
    while proc_state(run.pid) not in ("Z", None) and time.monotonic() < deadline:
        time.sleep(0.001)  # no checkpoint: the run's task cannot look meanwhile
    assert proc_state(run.pid) == "Z"  # dead of SIGINT, not reaped yet
    with trio.fail_after(10):
        result = await supervisor.cancel(run)
    assert result.reason is TerminationReason.CANCELLED
    assert (result.signal, result.escalated) == (signal.SIGINT, False)


async def test_cancel_by_caller_cancellation_still_reaps(supervisor: Supervisor) -> None:
    run = await supervisor.spawn(SpawnSpec(argv=("bash", "-c", f"trap '' INT; sleep {mark('321.6')}")))
    await wait_until(lambda: bool(pgrep(rf"^sleep 321\.6{SESSION}")))  # the trap is set
    with trio.move_on_after(0.05):
        await supervisor.cancel(run)
    # The caller's cancellation is re-raised only after the tree is reaped.
    assert run.state is RunState.EXITED
    assert not proc_exists(run.pid)
    assert not pgrep(rf"sleep 321\.6{SESSION}")


@pytest.mark.serial
async def test_max_runtime_ends_the_run(supervisor: Supervisor) -> None:
    run = await supervisor.spawn(SpawnSpec(argv=("sleep", mark("321.5")), max_runtime_seconds=0.2))
    with trio.fail_after(10):
        result = await run.wait()
    assert result.reason is TerminationReason.MAX_RUNTIME
    assert result.signal == signal.SIGINT
    assert 0.2 <= result.duration_seconds < 2


async def test_leader_exit_cleans_group_left_behind(supervisor: Supervisor) -> None:
    run = await supervisor.spawn(
        SpawnSpec(
            argv=("bash", "-c", f"sleep {mark('322.1')} & setsid sleep {mark('322.2')} & sleep 0.2; exit 4")
        )
    )
    with trio.fail_after(10):
        result = await run.wait()
    assert result.exit_code == 4
    assert result.reason is TerminationReason.EXIT
    assert result.escalated  # the & jobs ignore SIGINT
    assert not pgrep(rf"sleep 322\.[12]{SESSION}")


async def test_runs_lists_live_runs_by_scope(supervisor: Supervisor) -> None:
    a = await supervisor.spawn(SpawnSpec(argv=("sleep", mark("323.1")), scope_key="a"))
    b = await supervisor.spawn(SpawnSpec(argv=("sleep", mark("323.2")), scope_key="b"))
    assert supervisor.runs("a") == [a]
    assert supervisor.runs() == [a, b]
    assert mark("323.1") in repr(a) and "running" in repr(a)
    exits = await supervisor.cancel_scope("a")
    assert len(exits) == 1 and exits[0].reason is TerminationReason.CANCELLED
    assert supervisor.runs() == [b]
    assert "killed by signal 2" in repr(a)


async def test_replace_existing_reaps_old_run_before_new_pid_exists(supervisor: Supervisor) -> None:
    a = await supervisor.spawn(SpawnSpec(argv=("sleep", mark("324.1")), scope_key="k"))
    b = await supervisor.spawn(
        SpawnSpec(argv=("sleep", mark("324.2")), scope_key="k", replace_existing_scope=True)
    )
    assert a.state is RunState.EXITED
    assert a.exit is not None and a.exit.reason is TerminationReason.CANCELLED
    assert not proc_exists(a.pid)
    assert supervisor.runs("k") == [b]


async def test_replace_existing_concurrent_replacements_leave_one_run(supervisor: Supervisor) -> None:
    await supervisor.spawn(
        SpawnSpec(argv=("bash", "-c", f"trap '' INT; sleep {mark('324.3')}"), scope_key="k")
    )
    started: list[ManagedRun] = []

    async def replace(n: int) -> None:
        spec = SpawnSpec(argv=("sleep", mark(f"324.{4 + n}")), scope_key="k", replace_existing_scope=True)
        started.append(await supervisor.spawn(spec))

    with trio.fail_after(15):
        async with trio.open_nursery() as nursery:
            for n in range(4):
                nursery.start_soon(replace, n)
    live = supervisor.runs("k")
    assert len(live) == 1
    assert live[0] is started[-1]
    assert len(pgrep(rf"sleep 324\.[0-9]{SESSION}")) == 1


async def test_cancel_scope_covers_replacement_in_flight(supervisor: Supervisor) -> None:
    await supervisor.spawn(
        SpawnSpec(argv=("bash", "-c", f"trap '' INT; sleep {mark('324.9')}"), scope_key="k")
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            supervisor.spawn,
            SpawnSpec(argv=("sleep", mark("324.91")), scope_key="k", replace_existing_scope=True),
        )
        await (
            trio.testing.wait_all_tasks_blocked()
        )  # the replacement now holds the key, waiting for the old run
        with trio.fail_after(10):
            await supervisor.cancel_scope("k")
    assert supervisor.runs("k") == []
    assert not pgrep(rf"sleep 324\.9{SESSION}|sleep 324\.91{SESSION}")


async def test_spawn_in_five_hundred_runs_leaves_fd_count_unchanged(
    supervisor: Supervisor, tmp_path: Path
) -> None:
    log = str(tmp_path / "log")
    run = await supervisor.spawn(SpawnSpec(argv=("true",), stdout=log, stderr=log))
    await run.wait()
    before = open_fds()
    with trio.fail_after(120):
        for _ in range(500):
            run = await supervisor.spawn(SpawnSpec(argv=("true",), stdout=log, stderr=log))
            await run.wait()
        for _ in range(5):
            with pytest.raises(SpawnError):
                await supervisor.spawn(SpawnSpec(argv=("no-such-program-325",), stdout=log))
    assert open_fds() == before


@pytest.mark.parametrize("how", ["return", "raise", "cancel"])
async def test_open_supervisor_exit_reaps_every_child(how: str) -> None:
    pids: list[int] = []

    async def body() -> None:
        async with open_supervisor(grace_seconds=0.3) as sup:
            shell = f"sleep {mark('326.2')} & setsid sleep {mark('326.3')} & wait"
            for argv in (("sleep", mark("326.1")), ("bash", "-c", shell)):
                pids.append((await sup.spawn(SpawnSpec(argv=argv))).pid)
            await wait_until(lambda: len(pgrep(rf"^sleep 326\.[123]{SESSION}")) == 3)
            if how == "raise":
                raise KeyError("boom")
            if how == "cancel":
                await trio.sleep_forever()

    with trio.fail_after(10):
        if how == "raise":
            with pytest.raises(KeyError):
                await body()
        elif how == "cancel":
            with trio.move_on_after(0.5) as scope:
                await body()
            assert scope.cancelled_caught
        else:
            await body()
    assert not pgrep(rf"sleep 326\.[123]{SESSION}")
    assert not any(proc_exists(p) for p in pids)


def _lookup(table: dict[str, int], key: str) -> int:
    return table[key]


async def test_open_supervisor_error_keeps_its_cause_context_and_traceback() -> None:
    with pytest.raises(ValueError, match="bad config") as caught:
        async with open_supervisor(grace_seconds=0.3):
            try:
                _lookup({}, "port")
            except KeyError as exc:
                raise ValueError("bad config") from exc
    error = caught.value
    assert isinstance(error.__cause__, KeyError) and error.__suppress_context__
    assert error.__context__ is error.__cause__  # not the nursery's group
    names = [entry.name for entry in caught.traceback]
    assert "test_open_supervisor_error_keeps_its_cause_context_and_traceback" in names
    with pytest.raises(RuntimeError) as implicit:
        async with open_supervisor(grace_seconds=0.3):
            try:
                _lookup({}, "port")
            except KeyError:
                raise RuntimeError("while looking up")  # noqa: B904  # the implicit context is checked
    assert isinstance(implicit.value.__context__, KeyError) and not implicit.value.__suppress_context__
    assert implicit.value.__cause__ is None
    # The leaf's own traceback is kept: the frame that raised the KeyError is still reachable.
    key_error = implicit.value.__context__
    assert "_lookup" in [frame.name for frame in traceback.extract_tb(key_error.__traceback__)]


def test_unwrap_single_raises_the_leaf_with_what_it_carried() -> None:
    def fail() -> None:
        try:
            _lookup({}, "x")
        except KeyError:
            raise ValueError("leaf")  # noqa: B904  # the implicit context is what is checked

    try:
        fail()
    except ValueError as exc:
        leaf = exc
    group = BaseExceptionGroup("outer", [BaseExceptionGroup("inner", [leaf])])
    with pytest.raises(ValueError) as caught:
        try:
            raise group
        except BaseExceptionGroup as raised:
            unwrap_single(raised)
    assert caught.value is leaf
    assert isinstance(leaf.__context__, KeyError) and leaf.__cause__ is None
    assert "fail" in [frame.name for frame in traceback.extract_tb(leaf.__traceback__)]
    several = ExceptionGroup("two", [ValueError("a"), KeyError("b")])
    with pytest.raises(ExceptionGroup) as both:
        unwrap_single(several)
    assert both.value is several


async def test_open_supervisor_undoes_the_subreaper_only_when_it_set_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = _procfs._prctl()
    assert real is not None and not is_child_subreaper()

    def refusing(option: int, *args: object) -> int:
        return -1 if option == 36 else real(option, *args)  # PR_SET_CHILD_SUBREAPER fails

    opened, leave = trio.Event(), trio.Event()

    async def failed_one() -> None:
        async with open_supervisor(grace_seconds=0.3) as failed:
            assert not failed.subreaper
            opened.set()
            await leave.wait()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            monkeypatch.setattr(_procfs, "_prctl", lambda: refusing)
            nursery.start_soon(failed_one)
            await opened.wait()
            monkeypatch.undo()
            async with open_supervisor(grace_seconds=0.3) as working:
                assert working.subreaper and is_child_subreaper()
                leave.set()  # the one whose set failed leaves first: it must not undo the other's
                await trio.testing.wait_all_tasks_blocked()
                assert is_child_subreaper()
                run = await working.spawn(
                    SpawnSpec(argv=("bash", "-c", f"setsid sleep {mark('340.4')} & exit 0"))
                )
                assert (await run.wait()).exit_code == 0
    assert not pgrep(rf"sleep 340\.4{SESSION}")
    assert not is_child_subreaper()


async def test_spawn_after_close_is_refused() -> None:
    async with open_supervisor() as sup:
        pass
    with pytest.raises(RuntimeError, match="closed"):
        await sup.spawn(SpawnSpec(argv=("true",)))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({}, ValueError, "exactly one"),
        ({"argv": ("true",), "shell_command": "true"}, ValueError, "exactly one"),
        ({"argv": ()}, ValueError, "must not be empty"),
        ({"argv": ("",)}, ValueError, "must not be empty"),
        ({"argv": ("echo", 3)}, TypeError, "strings"),
        ({"shell_command": "  "}, ValueError, "blank"),
        ({"argv": ("true",), "grace_seconds": -1}, ValueError, "grace_seconds"),
        ({"argv": ("true",), "stdout": 1.5}, TypeError, "stdout"),
    ],
)
def test_spawn_spec_rejects_bad_input(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        SpawnSpec(**kwargs)  # type: ignore[arg-type]  # deliberately wrong types


async def test_spawn_bad_cwd_raises_and_registers_nothing(supervisor: Supervisor, tmp_path: Path) -> None:
    other = await supervisor.spawn(SpawnSpec(argv=("sleep", mark("327.1"))))
    with pytest.raises(SpawnError, match="working directory") as info:
        await supervisor.spawn(SpawnSpec(argv=("true",), cwd=str(tmp_path / "missing")))
    assert info.value.filename == str(tmp_path / "missing")
    assert isinstance(info.value, OSError)
    assert supervisor.runs() == [other]
    assert other.state is RunState.RUNNING


def test_engine_with_sigint_ignored_still_stops_child_with_sigint(tmp_path: Path) -> None:
    script = (
        "import signal, sys, trio\n"
        "from engine import open_supervisor, SpawnSpec\n"
        "assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN\n"
        "code='import signal,sys,time\\ndef h(s,f):\\n    sys.exit(7)\\n"
        f"signal.signal(signal.SIGINT,h)\\nprint(1,flush=True)\\ntime.sleep({mark('30.1')})'\n"
        "async def main():\n"
        "    async with open_supervisor(grace_seconds=5) as sup:\n"
        f"        out = {str(tmp_path / 'o')!r}\n"
        "        run = await sup.spawn(SpawnSpec(argv=(sys.executable,'-c',code), stdout=out))\n"
        "        while '1' not in open(out).read():\n"  # the handler is set
        "            await trio.sleep(0.01)\n"
        "        print(await sup.cancel(run))\n"
        "trio.run(main)\n"
    )
    # As a background job of a non-interactive shell, the engine inherits SIGINT ignored.
    proc = subprocess.run(
        ["sh", "-c", f'{sys.executable} -c "$1" & wait', "sh", script],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "exit_code=7" in proc.stdout
    assert "escalated=False" in proc.stdout


# ---- runs that outlive the engine (on-exit watched commands) ------------------------------------------


async def _leave_as(how: str, outer: trio.CancelScope) -> None:
    """Leave the supervisor's block as ``how`` says: ``return``, ``error`` (a ValueError) or ``cancel``
    (``outer`` cancelled)."""
    if how == "error":
        raise ValueError("the body failed")
    if how == "cancel":
        outer.cancel()
        await trio.sleep_forever()


@pytest.mark.parametrize("how", ["return", "error", "cancel"])
async def test_close_detaches_outlive_runs_unsignalled_and_ends_the_others(how: str, tmp_path: Path) -> None:
    kept, ended = mark("338.1"), mark("338.2")
    watched: ManagedRun | None = None
    try:
        with trio.CancelScope() as outer:
            try:
                # An engine's containment: recorded in its state directory, where the next engine finds it.
                async with (
                    open_containment("auto", state_dir=str(tmp_path)) as containment,
                    open_supervisor(grace_seconds=0.3, containment=containment) as sup,
                ):
                    watched = await sup.spawn(
                        SpawnSpec(argv=cooperative(kept), outlive_engine_crash=True, scope_key="cron-exit:j")
                    )
                    other = await sup.spawn(SpawnSpec(argv=("sleep", ended)))
                    await wait_until(lambda: bool(pgrep(rf"time.sleep\({kept}\)")))
                    await _leave_as(how, outer)
            except ValueError:
                assert how == "error"
        assert other.state is RunState.EXITED and not pgrep(rf"^sleep {ended}$")
        # Detached: still running (it would have printed "bye" and exited on SIGINT), forgotten.
        assert watched is not None
        assert pgrep(rf"time.sleep\({kept}\)") == [watched.pid]
        assert watched.state is RunState.RUNNING and watched.exit is None
        assert sup.runs() == []
    finally:
        for pid in pgrep(rf"time.sleep\({kept}\)"):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)  # our child: reap it here
        if watched is not None and watched.cgroup is not None:  # its leaf, and the supervisor's parent
            leaf = Path(watched.cgroup)
            for empty in (leaf, leaf.parent):
                with contextlib.suppress(OSError):
                    empty.rmdir()


@pytest.mark.parametrize("how", ["return", "error", "cancel"])
async def test_a_bare_supervisor_ends_its_outlive_runs_at_close(how: str) -> None:
    # Found by a new user: a supervisor without a state directory detached its `outlive_engine_crash` runs
    # at close as an engine's does, though no next engine could ever find them: the run and its leaf
    # stayed on the machine.
    kept = mark("338.4")
    watched: ManagedRun | None = None
    with trio.CancelScope() as outer:
        try:
            async with open_supervisor(grace_seconds=0.3) as sup:
                watched = await sup.spawn(SpawnSpec(argv=cooperative(kept), outlive_engine_crash=True))
                await wait_until(lambda: bool(pgrep(rf"time.sleep\({kept}\)")))
                await _leave_as(how, outer)
        except ValueError:
            assert how == "error"
    assert watched is not None
    assert not pgrep(rf"time.sleep\({kept}\)")
    assert watched.state is RunState.EXITED
    assert watched.exit is not None and watched.exit.reason is TerminationReason.CANCELLED
    if watched.cgroup is not None:
        assert not os.path.exists(watched.cgroup)  # its leaf went with it, and the parent with the close
        assert not os.path.exists(os.path.dirname(watched.cgroup))


async def test_cancel_still_ends_an_outlive_run(supervisor: Supervisor) -> None:
    run = await supervisor.spawn(SpawnSpec(argv=("sleep", mark("338.3")), outlive_engine_crash=True))
    with trio.fail_after(10):
        result = await supervisor.cancel(run)
    assert result.reason is TerminationReason.CANCELLED and result.signal == signal.SIGINT


async def test_spawn_of_an_idle_scope_checks_cancel_first_and_yields_after_the_start() -> None:
    """With nobody holding its scope's lock a spawn starts at once: cancelled before, it starts nothing;
    it is still a checkpoint (taken after the start, so that the loop's waiting work runs while the
    child starts), and a cancellation there cannot lose the run it started."""
    async with open_supervisor(grace_seconds=0.3) as sup:
        with trio.CancelScope() as scope:
            scope.cancel()
            await sup.spawn(SpawnSpec(argv=("true",)))
        assert sup.runs() == []
        with trio.testing.assert_checkpoints():
            first = await sup.spawn(SpawnSpec(argv=("true",)))
        await first.wait()
        with trio.CancelScope() as scope:
            scope.deadline = trio.current_time()  # due at the spawn's checkpoint, after the start
            run = await sup.spawn(SpawnSpec(argv=("sleep", "5")))
        assert not scope.cancelled_caught and sup.runs() == [run]
        assert (await sup.cancel(run)).reason is TerminationReason.CANCELLED


async def test_waiters_of_a_run_go_on_before_its_housekeeping(supervisor: Supervisor) -> None:
    # The housekeeping after a run's end (its leaf removed, the observers told) waits until the tasks the
    # end woke have run: Trio runs one pass's tasks in either order, and after a single checkpoint the
    # housekeeping came first in about half the ends. Twenty ends in a row tell the two apart.
    order: list[str] = []

    class Recorder:
        def run_started(self, run: ManagedRun) -> None:
            pass

        def run_ended(self, run: ManagedRun) -> None:
            order.append("housekeeping")

    supervisor.add_observer(Recorder())
    with trio.fail_after(30):
        for _ in range(20):
            order.clear()
            run = await supervisor.spawn(SpawnSpec(argv=("true",)))
            await run.wait()
            order.append("waiter")
            while "housekeeping" not in order:
                await trio.sleep(0)
            assert order == ["waiter", "housekeeping"]
