"""Children never outlive the engine: the guardian after an engine SIGKILL, and the start-up sweep."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from engine import EngineConfig, SpawnSpec, open_engine
from engine._procfs import read_proc
from engine._sweep import GroupRecord, end_processes, load_records, records_dir

from .children import (
    SESSION,
    ignoring_sigint,
    kill_leftovers,
    mark,
    pgrep,
    proc_exists,
    wait_for_text,
    wait_until,
)

ROOT = Path(__file__).parent.parent
STUBBORN = f"sleep {mark('331.1')} & setsid sleep {mark('331.2')} & trap '' INT; sleep {mark('331.3')}; wait"
#: The sleeps of STUBBORN and of ``sleep 331.4``, this session's only.
SLEEPS_1_4 = rf"^sleep 331\.[1-4]{SESSION}"
SLEEPS_1_3 = rf"^sleep 331\.[123]{SESSION}"
#: The on-exit command's sleep in the serve test.
WATCHED = rf"^sleep 4\.5{SESSION}"


def start_engine(
    state: Path, grace: float, *pairs: tuple[Path, str], containment: str = "auto"
) -> tuple[subprocess.Popen[str], list[int]]:
    args = [a for project, command in pairs for a in (str(project), command)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.crash_engine", str(state), str(grace), containment, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    assert line and line[0] == "ready", line
    return proc, [int(p) for p in line[1:]]


def sigkill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.stdout is not None
    proc.stdout.close()


def guardian_pids(state: Path) -> list[int]:
    """The guardians of the engine on ``state`` (their argv: the bootstrap, the engine folder, ``state``)."""
    return pgrep(rf"engine\._guardian import main.* {state} ")


async def wait_gone(pattern: str, seconds: float) -> float:
    t0 = time.monotonic()
    with trio.fail_after(seconds):
        while pgrep(pattern):
            await trio.sleep(0.05)
    return time.monotonic() - t0


@pytest.mark.serial
async def test_guardian_ends_children_after_engine_sigkill(tmp_path: Path, containment: str) -> None:
    projects = [tmp_path / "p1", tmp_path / "p2"]
    for p in projects:
        p.mkdir()
    try:
        proc, _ = start_engine(
            tmp_path / "state",
            5.0,
            (projects[0], STUBBORN),
            (projects[1], f"sleep {mark('331.4')} & wait"),
            containment=containment,
        )
        await wait_until(lambda: len(pgrep(SLEEPS_1_4)) >= 4)
        assert len(pgrep(SLEEPS_1_4)) == 4
        t0 = time.monotonic()
        sigkill(proc)
        with trio.fail_after(8):
            while pgrep(SLEEPS_1_4):
                await trio.sleep(0.05)
        assert time.monotonic() - t0 <= 8.0
        with trio.fail_after(2):  # then the guardian drops the records
            while list((tmp_path / "state" / "groups").iterdir()):
                await trio.sleep(0.02)
        if containment == "cgroup":  # and the engine's cgroup, empty now (found by a new user: left behind)
            parent = (tmp_path / "state" / "cgroup.path").read_text().strip()
            with trio.fail_after(2):
                while os.path.exists(parent):
                    await trio.sleep(0.02)
    finally:
        kill_leftovers(SLEEPS_1_4)


async def test_the_guardian_is_a_helper_the_runs_looks_leave_out_until_it_is_reaped(tmp_path: Path) -> None:
    """The guardian is the engine's own child (``_procfs.add_helper``): the looks for a run's orphans among
    the engine's children leave it out without reading it, and forget it once it is reaped."""
    from engine._procfs import engine_children, engine_helpers

    config = EngineConfig(state_dir=str(tmp_path), grace_seconds=0.3, containment="process-group")
    async with open_engine(config) as engine:
        with trio.fail_after(5):
            while not guardian_pids(tmp_path):
                await trio.sleep(0.02)
        (guardian,) = guardian_pids(tmp_path)
        assert guardian in engine_helpers() and guardian in engine_children()
        run = await engine.supervisor.spawn(SpawnSpec(argv=("sleep", mark("332.15"))))
        assert guardian not in run._tree._not_leaders(engine_children())
        await engine.supervisor.cancel(run)
    assert guardian not in engine_helpers()
    assert not proc_exists(guardian)


async def test_guardian_exits_with_engine_on_graceful_shutdown(tmp_path: Path, containment: str) -> None:
    config = EngineConfig(state_dir=str(tmp_path), grace_seconds=0.3, containment=containment)
    async with open_engine(config) as engine:
        await engine.supervisor.spawn(SpawnSpec(argv=("sleep", mark("332.1"))))
        with trio.fail_after(5):
            while not guardian_pids(tmp_path):
                await trio.sleep(0.02)
    assert not guardian_pids(tmp_path)
    assert not pgrep(rf"^sleep 332\.1{SESSION}")


async def test_sweep_ends_leftovers_when_guardian_died_too(tmp_path: Path, containment: str) -> None:
    state = tmp_path / "state"
    try:
        proc, _ = start_engine(state, 0.3, (tmp_path, STUBBORN), containment=containment)
        await wait_until(lambda: len(pgrep(SLEEPS_1_3)) >= 3)
        with trio.fail_after(5):
            while not guardian_pids(state):
                await trio.sleep(0.02)
        for pid in guardian_pids(state):  # the guardian first, then the engine: nobody cleans up
            os.kill(pid, signal.SIGKILL)
        sigkill(proc)
        await trio.sleep(0.3)  # nobody ends them meanwhile
        assert len(pgrep(SLEEPS_1_3)) == 3
        # A stranger whose pid is in a record with another start time must be left alone.
        stranger = subprocess.Popen(["sleep", mark("333.1")])
        info = read_proc(stranger.pid)
        assert info is not None
        records_dir(str(state))
        GroupRecord(stranger.pid, info.sid, info.start_time - 1, "someone:1").write(str(state))
        async with open_engine(
            EngineConfig(state_dir=str(state), grace_seconds=0.3, containment=containment)
        ):
            assert not pgrep(SLEEPS_1_3)  # swept at start-up, before open_engine returned
            assert stranger.poll() is None
        assert not os.listdir(state / "groups")
        stranger.kill()
        stranger.wait()
    finally:
        kill_leftovers(rf"sleep 33[13]\.[123]{SESSION}")


@pytest.mark.parametrize("outlive", [True, False])
async def test_guardian_skips_runs_that_outlive_engine_crash(
    tmp_path: Path, outlive: bool, containment: str
) -> None:
    state = tmp_path / "state"
    config = EngineConfig(state_dir=str(state), grace_seconds=0.3, containment=containment)
    try:
        async with open_engine(config) as engine:
            run = await engine.supervisor.spawn(
                SpawnSpec(argv=("sleep", mark("334.1")), outlive_engine_crash=outlive)
            )
            if containment == "cgroup":  # no group record: the guardian ends every leaf but w-*
                assert run.cgroup is not None
                assert os.path.basename(run.cgroup).startswith("w-") is outlive
            else:
                recorded = {(r.pgid, r.start_time) for r in load_records(str(state))}
                assert ((run.pid, run.start_time) in recorded) is not outlive
        # A graceful exit leaves a watched command running (for the next engine), and ends the rest.
        assert pgrep(rf"^sleep 334\.1{SESSION}") == ([run.pid] if outlive else [])
    finally:
        kill_leftovers(rf"^sleep 334\.1{SESSION}")


@pytest.mark.serial
async def test_guardian_serve_sigkill_ends_project_children_keeps_watched_command(tmp_path: Path) -> None:
    from .serve_support import start_serve

    projects = [tmp_path / "p1", tmp_path / "p2"]
    for p in projects:
        p.mkdir()
    state = tmp_path / "state"
    served = start_serve(state, "--grace-seconds", "5")  # the default grace: `trap '' INT` needs SIGKILL
    try:
        for project, command in ((projects[0], STUBBORN), (projects[1], f"sleep {mark('331.4')}")):
            result = served.cli("create", "--project", str(project), "--", "bash", "-c", command)
            assert result.returncode == 0, result.stderr
        armed = served.cli(
            "cron", "add", "--on-exit", f"sleep {mark('4.5')}; echo survived", "--text", "watched"
        )
        assert armed.returncode == 0, armed.stderr
        with trio.fail_after(5):
            while len(pgrep(SLEEPS_1_4)) < 4 or not pgrep(WATCHED):
                await trio.sleep(0.05)
        (watched,) = pgrep(WATCHED)
        t0 = time.monotonic()
        served.kill_hard()
        await trio.sleep(0.5)
        assert pgrep(WATCHED) == [watched]  # SIGINT went out; the watched command was skipped
        served = start_serve(state)  # adopts the live watched command
        with trio.fail_after(8):
            while pgrep(SLEEPS_1_4):
                await trio.sleep(0.05)
        assert time.monotonic() - t0 <= 8.0
        with trio.fail_after(10):
            while '"survived' not in (events := served.cli("events", "--since", "0", "--json")).stdout:
                assert events.returncode == 0, events.stderr
                await trio.sleep(0.1)
        await trio.sleep(0.3)
        lines = served.cli("events", "--since", "0", "--json").stdout.splitlines()
        assert len(lines) == 1  # adopted and fired once
        assert served.stop() == 0
    finally:
        if served.proc.poll() is None:
            served.kill_hard()
        kill_leftovers(rf"sleep 331\.[1-4]{SESSION}|sleep 4\.5{SESSION}")


def _start(argv: tuple[str, ...], out: Path) -> tuple[subprocess.Popen[bytes], int]:
    with open(out, "wb") as f:
        proc = subprocess.Popen(argv, stdout=f, start_new_session=True)
    info = read_proc(proc.pid)
    assert info is not None
    return proc, info.start_time


@pytest.mark.serial
async def test_end_processes_escalates_and_never_touches_a_stranger(tmp_path: Path) -> None:
    """The blocking driver: SIGINT, the grace, SIGKILL for what ignored it; a reused pid is left alone."""
    stubborn, stubborn_start = _start(ignoring_sigint(mark("340.5")), tmp_path / "stubborn.out")
    polite, polite_start = _start(("sleep", mark("340.6")), tmp_path / "polite.out")
    stranger, stranger_start = _start(("sleep", mark("340.7")), tmp_path / "stranger.out")
    try:
        await wait_for_text(tmp_path / "stubborn.out", "ready")
        targets = {stubborn.pid: stubborn_start, polite.pid: polite_start, stranger.pid: stranger_start - 1}
        t0 = time.monotonic()
        survivors = await trio.to_thread.run_sync(
            lambda: end_processes(targets, grace_seconds=0.5, kill_wait_seconds=2.0)
        )
        elapsed = time.monotonic() - t0
        assert survivors == []
        assert 0.5 <= elapsed < 1.5
        assert stubborn.wait(timeout=1) == -signal.SIGKILL
        assert polite.wait(timeout=1) == -signal.SIGINT
        assert stranger.poll() is None
    finally:
        for proc in (stubborn, polite, stranger):
            proc.kill()
            proc.wait()


def test_guardian_reads_the_lines_of_many_runs_in_a_few_wakes_and_acts_on_the_last(tmp_path: Path) -> None:
    """The guardian reads its pipe in batches (``_guardian.BATCH_SECONDS``): 300 lines written one by one
    over about 0.6 s wake it a few times, not 300; a group registered by the very last lines before the
    end of the pipe is still ended, and one registered then dropped is left alone."""
    from engine._guardian import BOOTSTRAP

    state = tmp_path / "state"
    state.mkdir()
    records_dir(str(state))
    kept = subprocess.Popen(["sleep", mark("331.7")], start_new_session=True)
    dropped = subprocess.Popen(["sleep", mark("331.8")], start_new_session=True)
    read, write = os.pipe()
    guardian = subprocess.Popen(
        [sys.executable, "-c", BOOTSTRAP, str(ROOT / "engine"), str(state), "0.2", "1.0"],
        stdin=read,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    os.close(read)
    try:
        time.sleep(0.3)  # started and waiting on the pipe

        def switches() -> int:
            status = Path(f"/proc/{guardian.pid}/status").read_text()
            return int(status.split("voluntary_ctxt_switches:")[1].split()[0])

        before = switches()
        for i in range(150):  # registered and dropped at once, as short runs are
            os.write(write, f"+ {10**6 + i} {10**6 + i} 1 x:{i}\n- {10**6 + i} 1\n".encode())
            time.sleep(0.004)
        woken = switches() - before
        assert woken < 40, woken  # one wake per 0.1 s at most (about 8), with a few of Python's own
        starts = {}
        for proc in (kept, dropped):
            info = read_proc(proc.pid)
            assert info is not None
            starts[proc.pid] = info.start_time
            os.write(write, f"+ {proc.pid} {proc.pid} {info.start_time} none:1\n".encode())
        os.write(write, f"- {dropped.pid} {starts[dropped.pid]}\n".encode())
        os.close(write)
        write = -1
        assert guardian.wait(timeout=10) == 0
        assert kept.wait(timeout=5) == -signal.SIGINT
        assert dropped.poll() is None
    finally:
        if write >= 0:
            os.close(write)
        for proc in (kept, dropped, guardian):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert guardian.stdout is not None
        guardian.stdout.close()


@pytest.mark.serial  # a time bound: measured alone (make test runs the rest two at a time)
def test_guardian_sees_the_end_of_the_pipe_at_once_between_batches(tmp_path: Path) -> None:
    """Between two batches the guardian waits for the engine's end closing only: a stop right after a
    line is seen at once, not a batch later (an engine's stop waits for its guardian). Here with batches
    of 5 s."""
    state = tmp_path / "state"
    state.mkdir()
    records_dir(str(state))
    code = (
        "import sys; from engine import _guardian as g; g.BATCH_SECONDS = 5.0; sys.exit(g.main(sys.argv[1:]))"
    )
    read, write = os.pipe()
    guardian = subprocess.Popen([sys.executable, "-c", code, str(state), "0.2", "1.0"], stdin=read, cwd=ROOT)
    os.close(read)
    try:
        time.sleep(0.5)
        os.write(write, b"+ 999999 999999 1 x:1\n- 999999 1\n")  # read at once, then a batch's wait
        time.sleep(0.1)
        t0 = time.monotonic()
        os.close(write)
        write = -1
        assert guardian.wait(timeout=10) == 0
        assert time.monotonic() - t0 < 2.0  # not the 5 s batch
    finally:
        if write >= 0:
            os.close(write)
        if guardian.poll() is None:
            guardian.kill()
            guardian.wait()


async def test_the_guardians_pipe_holds_a_kill_all_of_lines_while_it_sleeps(tmp_path: Path) -> None:
    """The engine writes to the guardian from its loop with plain blocking writes, and the guardian reads
    in batches: the pipe is asked for 1 MiB (``PIPE_BYTES``), room for a ``kill_all`` of 1000 runs'
    lines, so the loop never waits for the guardian's next batch."""
    from engine._guardian_link import PIPE_BYTES, GuardianLink

    state = tmp_path / "state"
    state.mkdir()
    link = GuardianLink(str(state), 0.2, 1.0)
    link.start()
    try:
        assert link.pid is not None
        fd = os.open(f"/proc/{link.pid}/fd/0", os.O_RDONLY | os.O_NONBLOCK)  # the guardian's end of it
        try:
            assert fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ) >= PIPE_BYTES
        finally:
            os.close(fd)
    finally:
        with trio.fail_after(10):
            await link.close()


async def test_runs_ended_together_are_told_in_one_journal_write_and_one_pipe_write(tmp_path: Path) -> None:
    """``GuardianLink.runs_ended`` (the runs a ``kill_all`` pass ended): one write to the journal and one
    to the pipe for all of them; the journal then replays only the runs still live, and a guardian whose
    engine dies right after ends those and leaves the ended ones alone (their groups may be anyone's)."""
    import attrs

    from engine._group_journal import journal_path, read_journal
    from engine._guardian_link import GuardianLink

    @attrs.frozen
    class Run:  # what the link reads of a ManagedRun
        pid: int
        start_time: int
        marker: str
        outlive_engine_crash: bool = False
        cgroup: str | None = None

        @property
        def pgid(self) -> int:
            return self.pid

    state = tmp_path / "state"
    state.mkdir()
    procs = [subprocess.Popen(["sleep", mark("331.9")], start_new_session=True) for _ in range(6)]
    runs = []
    for proc in procs:
        info = read_proc(proc.pid)
        assert info is not None
        runs.append(Run(proc.pid, info.start_time, f"other:{proc.pid}"))
    link = GuardianLink(str(state), 0.2, 1.0, token="cafe01")
    link.record_token()
    link.start()
    try:
        for run in runs:
            link.run_started(run)  # type: ignore[arg-type]  # the fields the link reads
        journal = journal_path(records_dir(str(state)), "cafe01")
        size = journal.stat().st_size

        def writes() -> int:  # this thread's write calls so far
            io = Path("/proc/thread-self/io").read_text()
            return int(io.split("syscw:")[1].split()[0])

        before = writes()
        link.runs_ended(runs[:4])  # type: ignore[arg-type]
        assert writes() - before == 2  # the journal's and the pipe's
        assert journal.stat().st_size > size
        assert [r.pgid for r in read_journal(journal)] == [run.pid for run in runs[4:]]
        before = writes()
        link.runs_ended(runs[:4])  # type: ignore[arg-type]  # told already: nothing written
        assert writes() == before
        assert link.pid is not None
        guardian = link.pid
        os.close(link._pipe)  # the engine dies: the guardian ends what is still registered
        link._pipe = -1
        with trio.fail_after(10):
            while link._reap_guardian(block=False) is False:
                await trio.sleep(0.02)
        assert not os.path.exists(f"/proc/{guardian}")
        for proc in procs[4:]:
            assert proc.wait(timeout=5) == -signal.SIGINT
        assert all(proc.poll() is None for proc in procs[:4])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        with trio.fail_after(10):
            await link.close()
