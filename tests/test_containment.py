"""Containment in both modes: what each catches (NB-01, NB-02), the races around a run's start and end
(SP-03, SP-16), unclaimed orphans, two engines on one machine, a failed create after the spawn."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from engine import EngineError, KillInProgressError, Project, SubProcess, open_supervisor
from engine._containment import open_containment

from .children import SESSION, kill_leftovers, mark, open_fds, pgrep, proc_exists, wait_for_text, wait_until
from .conftest import cgroup_unusable
from .serve_support import start_serve
from .service_support import engine_at, make_project

#: NB-01: a daemon in a new session with a scrubbed environment; its leader exits at once.
NB01 = (
    "import subprocess; subprocess.Popen(['sleep', '{marker}'], env={{'PATH': '/usr/bin:/bin'}}, "
    "start_new_session=True)"
)


def nb01(marker: str) -> list[str]:
    return ["-c", NB01.format(marker=marker)]


def _zombie_children() -> list[int]:
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{name}/stat").read_bytes().rpartition(b")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] == b"Z":
            found.append(int(name))
    return found


# ---- the mode ------------------------------------------------------------------------------------------


async def test_auto_resolves_to_cgroup_wherever_a_cgroup2_mount_is_writable(tmp_path: Path) -> None:
    why = cgroup_unusable()
    async with open_containment("auto", state_dir=str(tmp_path)) as chosen:
        if why:
            print(f"no writable cgroup v2 here ({why}): auto is process-group")
            assert chosen.mode == "process-group" and why in chosen.reason
        else:
            assert chosen.mode == "cgroup"
            assert chosen.describe().startswith("cgroup ")
    with pytest.raises(ValueError, match="containment must be one of"):
        async with open_containment("cgroups"):
            pass


async def test_status_reports_the_mode_in_use(tmp_path: Path, containment: str) -> None:
    async with engine_at(tmp_path, containment=containment) as engine:
        status = await engine.status()
        assert status.containment == containment and status.pid == os.getpid()
        assert status.state_dir == str(tmp_path / "state") and status.store.startswith("sqlite:")
        again = await engine.status()
        assert again.engine_id == status.engine_id != ""
    async with engine_at(tmp_path, containment=containment) as engine:
        assert (await engine.status()).engine_id == status.engine_id  # kept in the state dir


def test_cgroup_mode_where_none_is_writable_is_a_clear_error(tmp_path: Path) -> None:
    if not cgroup_unusable():
        pytest.skip("a writable cgroup v2 is here: the error path cannot be reached without one")

    async def start() -> None:
        async with engine_at(tmp_path, containment="cgroup"):
            pass

    with pytest.raises(EngineError, match="containment 'cgroup' needs a cgroup v2 hierarchy"):
        trio.run(start)


# ---- NB-01: a detached daemon with a scrubbed environment ----------------------------------------------


async def test_nb01_cgroup_daemon_ended_by_kill_all_after_its_leader_exited(
    tmp_path: Path, needs_cgroup: None
) -> None:
    project = make_project(tmp_path)
    marker = mark("7771.5")
    try:
        async with engine_at(tmp_path, containment="cgroup", grace_seconds=30.0) as engine:
            sp = await engine.service.create(project, sys.executable, nb01(marker))
            await wait_until(lambda: sp.exit is not None and bool(pgrep(rf"^sleep {marker}")))
            assert sp.exit is not None and sp.exit.exit_code == 0  # the leader is "exited 0" at once
            assert not sp.ended  # its leaf drains: the daemon is still in it
            t0 = time.monotonic()
            assert await engine.service.kill_all() is True  # every leaf verified empty
            assert time.monotonic() - t0 < 5  # sleep dies of SIGINT: no 30 s grace
            assert not pgrep(rf"^sleep {marker}")
    finally:
        kill_leftovers(rf"^sleep {marker}")


async def test_nb01_cgroup_daemon_ended_by_the_engines_exit(tmp_path: Path, needs_cgroup: None) -> None:
    project = make_project(tmp_path)
    marker = mark("7771.6")
    try:
        async with engine_at(tmp_path, containment="cgroup", grace_seconds=30.0) as engine:
            await engine.service.create(project, sys.executable, nb01(marker))
            await wait_until(lambda: bool(pgrep(rf"^sleep {marker}")))
        assert not pgrep(rf"^sleep {marker}")
    finally:
        kill_leftovers(rf"^sleep {marker}")


async def test_nb01_cgroup_daemon_ended_by_kill_pid_while_its_leader_runs(
    tmp_path: Path, needs_cgroup: None
) -> None:
    project = make_project(tmp_path)
    daemon, leader = mark("7771.7"), mark("7771.8")
    try:
        async with engine_at(tmp_path, containment="cgroup") as engine:
            sp = await engine.service.create(
                project, "bash", ["-c", f"setsid -f env -i sleep {daemon}; exec sleep {leader}"]
            )
            await wait_until(lambda: bool(pgrep(rf"^sleep {daemon}")) and bool(pgrep(rf"^sleep {leader}")))
            assert await engine.service.kill_pid(sp.pid) is True
            assert not pgrep(rf"^sleep {daemon}") and not pgrep(rf"^sleep {leader}")
    finally:
        kill_leftovers(rf"^sleep 7771\.[78]{SESSION}")


async def test_nb01_process_group_embedded_reports_the_daemon(tmp_path: Path) -> None:
    """Embedded in process-group mode the daemon cannot be told from the host's own children: it is named
    in the engine log and kill_all answers False (never True while it lives)."""
    project = make_project(tmp_path)
    marker = mark("7771.9")
    try:
        async with engine_at(tmp_path, containment="process-group") as engine:
            sp = await engine.service.create(project, sys.executable, nb01(marker))
            await wait_until(lambda: bool(pgrep(rf"^sleep {marker}")))
            await sp.wait()
            (daemon,) = pgrep(rf"^sleep {marker}")
            assert daemon in engine.supervisor.unclaimed_children()
            assert await engine.service.kill_all() is False
            assert pgrep(rf"^sleep {marker}") == [daemon]
    finally:
        kill_leftovers(rf"^sleep {marker}")


@pytest.mark.parametrize("containment_mode", ["process-group", "cgroup"])
def test_nb01_serve_ends_the_daemon_by_kill_all_and_by_its_exit(
    tmp_path: Path, containment_mode: str
) -> None:
    if containment_mode == "cgroup" and (why := cgroup_unusable()):
        pytest.skip(f"cgroup containment is not usable here: {why}")
    project = tmp_path / "p"
    project.mkdir()
    first, second = mark("7772.1"), mark("7772.2")
    # A grace long enough for both daemons to live at once: in cgroup mode a daemon stays in its run's
    # leaf, and the run's end ends it a grace period after its leader exited (SP-03). With serve's 0.5 s,
    # the first daemon was gone before the second create's CLI had started on a loaded machine. The
    # daemons are sleeps, which SIGINT ends at once: no step below waits out the grace.
    served = start_serve(tmp_path / "state", "--containment", containment_mode, "--grace-seconds", "10")
    try:
        for marker in (first, second):
            created = served.cli("create", "--project", str(project), "--", sys.executable, *nb01(marker))
            assert created.returncode == 0, created
        assert wait_until_sync(lambda: len(pgrep(rf"^sleep 7772\.[12]{SESSION}")) == 2)
        killed = served.cli("kill-all")
        assert killed.returncode == 0, (killed, served.log())  # verified: nothing left
        assert not pgrep(rf"^sleep 7772\.[12]{SESSION}")
        assert (
            served.cli("create", "--project", str(project), "--", sys.executable, *nb01(first)).returncode
            == 0
        )
        assert wait_until_sync(lambda: bool(pgrep(rf"^sleep {first}")))
        assert served.stop() == 0
        assert not pgrep(rf"^sleep {first}")  # the engine's exit ends it too
    finally:
        if served.proc.poll() is None:
            served.kill_hard()
        kill_leftovers(rf"^sleep 7772\.[12]{SESSION}")


def wait_until_sync(predicate: object, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]  # a callable
            return True
        time.sleep(0.02)
    return False


# ---- NB-02: zombies of adopted children are reaped promptly ----------------------------------------------


@pytest.mark.parametrize("containment_mode", ["process-group", "cgroup"])
def test_nb02_adopted_zombies_are_reaped_within_a_second_while_the_run_goes_on(
    tmp_path: Path, containment_mode: str
) -> None:
    if containment_mode == "cgroup" and (why := cgroup_unusable()):
        pytest.skip(f"cgroup containment is not usable here: {why}")
    project = tmp_path / "p"
    project.mkdir()
    short, long = mark("3.125"), mark("3001.5")
    served = start_serve(tmp_path / "state", "--containment", containment_mode)
    try:
        script = f"for i in 1 2 3 4 5; do ( sleep {short} & ); done; exec sleep {long}"
        assert served.cli("create", "--project", str(project), "--", "bash", "-c", script).returncode == 0
        engine = served.proc.pid
        assert wait_until_sync(lambda: len(pgrep(rf"^sleep {short}")) == 5)
        sleepers = pgrep(rf"^sleep {short}")
        assert all(_ppid(pid) == engine for pid in sleepers)  # re-parented to the subreaper
        deadline = time.monotonic() + float(short) + 1.0  # each exits after 3.125 s: reaped within 1 s
        while time.monotonic() < deadline and any(proc_exists(pid) for pid in sleepers):
            time.sleep(0.05)
        assert not any(proc_exists(pid) for pid in sleepers), [_state(pid) for pid in sleepers]
        assert pgrep(rf"^sleep {long}")  # the run goes on
    finally:
        served.stop()
        kill_leftovers(rf"^sleep (3\.125|3001\.5){SESSION}")


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[1])
    except OSError:
        return -1


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[0].decode()
    except OSError:
        return "gone"


# ---- SP-03: the leader exits while the rest of its tree is still writing ----------------------------------


@pytest.mark.serial  # a time bound: measured alone (make test runs the rest two at a time)
async def test_sp03_a_leader_is_exited_at_once_and_its_tree_drains(tmp_path: Path, containment: str) -> None:
    project = make_project(tmp_path)
    marker = mark("303.1")
    try:
        async with engine_at(tmp_path, containment=containment, grace_seconds=2.0) as engine:
            service = engine.service
            a = await service.create(
                project, "bash", ["-c", f"echo started; sleep {marker} & echo leader-done"]
            )
            b = await service.create(
                project, "bash", ["-c", "exec > >(tee -a tee-copy.txt) 2>&1; echo via-tee; exit 4"]
            )
            t0 = time.monotonic()
            c = await service.create(project, "bash", ["-c", "(sleep 1; echo late-line) & echo early-line"])
            for sp, code in ((a, 0), (b, 4)):
                with trio.fail_after(1.0):
                    while service.summarize(sp).status != f"exited {code}":
                        await trio.sleep(0.1)
            await wait_for_text(c.stdout_path, "late-line", seconds=2.0)
            assert time.monotonic() - t0 < 2.0
            assert Path(c.stdout_path).read_text() == "early-line\nlate-line\n"
            assert "via-tee" in Path(b.stdout_path).read_text()
            assert pgrep(rf"^sleep {marker}")  # (a)'s background sleep lives on after its leader
            t1 = time.monotonic()
            await service.kill_subprocess(a)  # ends the leftovers at once
            assert time.monotonic() - t1 < 6.0
            assert not pgrep(rf"^sleep {marker}")
    finally:
        kill_leftovers(rf"^sleep {marker}")


@pytest.mark.serial  # a time bound: measured alone (make test runs the rest two at a time)
@pytest.mark.parametrize("how", ["kill", "halt", "kill_all"])
async def test_sp03_a_stop_in_the_drain_ends_a_sigint_ignoring_leftover_at_once(
    tmp_path: Path, containment: str, how: str
) -> None:
    """Found by a new user: a ``kill`` while the leader's leftover drained ran a whole new grace period
    (10 s here) against a leftover that ignores SIGINT; the guide says the drain's leftovers end at once."""
    project = make_project(tmp_path)
    marker = mark("303.3")
    leftover = (
        "import signal,time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        f"signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep({marker})"
    )
    try:
        async with engine_at(tmp_path, containment=containment, grace_seconds=10.0) as engine:
            service = engine.service
            sp = await service.create(
                project,
                "bash",
                ["-c", f"setsid {sys.executable} -c '{leftover}' </dev/null >/dev/null 2>&1 & echo bye"],
            )
            with trio.fail_after(5):
                while service.summarize(sp).status != "exited 0":
                    await trio.sleep(0.05)
                while not pgrep(rf"time.sleep\({marker}\)"):
                    await trio.sleep(0.05)
            t0 = time.monotonic()
            with trio.fail_after(5):
                if how == "kill":
                    # Live leftovers were ended: not "had already stopped" (found by a new user).
                    assert await service.kill_subprocess(sp) is True
                elif how == "halt":
                    assert await service.halt_subprocess(sp) is True
                else:
                    await service.kill_all()
            assert time.monotonic() - t0 < 2.0  # not the 10 s grace period
            assert not pgrep(rf"time.sleep\({marker}\)")
            assert sp.exit is not None and sp.exit.exit_code == 0  # the leader's own exit is kept
            assert Path(sp.stdout_path).exists() == (how == "halt")
    finally:
        kill_leftovers(rf"time.sleep\({marker}\)")


async def test_sp03_tee_output_arrives_every_time(tmp_path: Path, containment: str) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path, containment=containment, grace_seconds=2.0) as engine:
        runs = [
            await engine.service.create(
                project, "bash", ["-c", "exec > >(tee -a tee-copy.txt) 2>&1; echo via-tee; exit 4"]
            )
            for _ in range(20)
        ]
        for sp in runs:
            with trio.fail_after(10):
                await sp.wait()
            assert "via-tee" in Path(sp.stdout_path).read_text()
            assert sp.exit is not None and sp.exit.exit_code == 4


async def test_sp03_a_hundred_created_and_killed_leave_the_fd_count(tmp_path: Path, containment: str) -> None:
    project = make_project(tmp_path)
    marker = mark("303.2")
    try:
        async with engine_at(tmp_path, containment=containment, grace_seconds=0.3) as engine:
            before = open_fds()
            made = [
                await engine.service.create(project, "bash", ["-c", f"sleep {marker} & echo leader-done"])
                for _ in range(100)
            ]
            await wait_until(lambda: all(sp.exit is not None for sp in made))
            async with trio.open_nursery() as nursery:
                for sp in made:
                    nursery.start_soon(engine.service.kill_subprocess, sp)
            # The log folders kept open go a second after the last record (RELEASE_FOLDERS_AFTER_SECONDS).
            await wait_until(lambda: abs(open_fds() - before) <= 2)
            assert not pgrep(rf"^sleep {marker}")
    finally:
        kill_leftovers(rf"^sleep {marker}")


# ---- SP-16: kill_all racing with create ----------------------------------------------------------------


@pytest.mark.parametrize("by_project", [False, True])
async def test_sp16_kill_all_fences_the_creates_in_flight(
    tmp_path: Path, containment: str, by_project: bool
) -> None:
    a, b = make_project(tmp_path, "a"), make_project(tmp_path, "b")
    marker = mark("311.1")
    code = ["-c", f"import time; time.sleep({marker})"]
    rounds = int(os.environ.get("SP16_ROUNDS", "5"))  # cases.md asks 20: SP16_ROUNDS=20 (about 35 s each)
    try:
        async with engine_at(
            tmp_path, containment=containment, max_processes=200, max_processes_per_project=100
        ) as engine:
            service = engine.service
            for _ in range(rounds):
                made: list[tuple[Project, SubProcess]] = []
                refused: list[Exception] = []

                async def create(
                    project: Project,
                    made: list[tuple[Project, SubProcess]] = made,
                    refused: list[Exception] = refused,
                ) -> None:
                    try:
                        made.append((project, await service.create(project, "python3", code)))
                    except KillInProgressError as refusal:
                        refused.append(refusal)

                async with trio.open_nursery() as nursery:
                    projects = [a, b] if by_project else [a]
                    for n in range(50):
                        nursery.start_soon(create, projects[n % len(projects)])
                    await trio.sleep(random.uniform(0, 0.02))
                    if by_project:
                        nursery.start_soon(service.kill_project, a.id)
                    else:
                        nursery.start_soon(service.kill_all)
                assert all("under way" in str(exc) for exc in refused)
                for project, sp in made:
                    if project is a:
                        assert sp not in service.ps()  # killed by that same call
                    else:
                        assert sp in service.ps() and sp.running
                if by_project:
                    await service.kill_project(b.id)
                with trio.fail_after(6.0):
                    while pgrep(rf"time\.sleep\({marker}\)"):
                        await trio.sleep(0.05)
            sp = await service.create(a, "python3", code)  # create works again afterwards
            assert sp.running
    finally:
        kill_leftovers(rf"time\.sleep\({marker}\)")


# ---- unclaimed orphans -----------------------------------------------------------------------------------


async def test_a_host_child_started_in_its_own_session_survives_kill_all(
    tmp_path: Path, containment: str
) -> None:
    marker = mark("7773.1")
    async with engine_at(tmp_path, containment=containment) as engine:
        host_child = subprocess.Popen(["sleep", marker], start_new_session=True)
        try:
            assert await engine.service.kill_all() is False  # reported, not ended: it is the host's
            assert host_child.poll() is None
        finally:
            host_child.kill()
            host_child.wait()


# ---- two engines on one machine ---------------------------------------------------------------------------


async def test_kill_all_of_one_engine_leaves_anothers_runs_alone(tmp_path: Path, containment: str) -> None:
    """Two engines with different state dirs on one machine (the other one a ``serve`` process)."""
    ours, theirs = mark("7774.1"), mark("7774.2")
    project = make_project(tmp_path)
    other = start_serve(tmp_path / "two", "--containment", containment)
    try:
        created = other.cli("create", "--project", project.directory, "--", "sleep", theirs)
        assert created.returncode == 0, created
        async with engine_at(tmp_path / "one", containment=containment) as one:
            mine = await one.service.create(project, "sleep", [ours])
            assert await one.service.kill_all() is True
            assert not pgrep(rf"^sleep {ours}") and len(pgrep(rf"^sleep {theirs}")) == 1
            assert not mine.running
        assert len(pgrep(rf"^sleep {theirs}")) == 1  # nor its exit
    finally:
        other.stop()
        kill_leftovers(rf"^sleep 7774\.[12]{SESSION}")


# ---- a run is recorded before it can outlive the engine ----------------------------------------------


async def test_a_failure_right_after_the_spawn_kills_the_child_first(
    tmp_path: Path, containment: str
) -> None:
    class Failing:
        def run_started(self, run: object) -> None:
            raise OSError(28, "No space left on device")

        def run_ended(self, run: object) -> None:
            pass

    marker = mark("7775.1")
    async with open_supervisor(grace_seconds=5.0, containment=containment) as sup:
        from engine import SpawnSpec

        sup.add_observer(Failing())
        zombies = set(_zombie_children())
        with pytest.raises(OSError, match="No space left"):
            await sup.spawn(SpawnSpec(argv=("bash", "-c", f"trap '' INT; sleep {marker}")))
        assert not pgrep(rf"sleep {marker}") and sup.runs() == []
        assert set(_zombie_children()) <= zombies  # killed and reaped before the error went up


# ---- watched on-exit commands keep their leaves ----------------------------------------------------------


def test_a_watched_command_keeps_its_leaf_across_a_stop_and_the_next_engine_ends_its_leftovers(
    tmp_path: Path, needs_cgroup: None
) -> None:
    """The command leaves a scrubbed daemon in its leaf and exits after its engine stopped: the next engine
    adopts it, fires once, then ends what is left in the leaf and removes the leaf."""
    daemon = mark("7776.1")
    state = tmp_path / "state"
    first = start_serve(state, "--containment", "cgroup")
    try:
        spawn_daemon = NB01.format(marker=daemon).replace("'", '"')
        command = f"python3 -c '{spawn_daemon}'; sleep 1.5"
        added = first.cli("cron", "add", "--on-exit", command, "--cwd", str(tmp_path), "--text", "done")
        assert added.returncode == 0, added
        assert wait_until_sync(lambda: bool(pgrep(rf"^sleep {daemon}")))
        (pid,) = pgrep(rf"^sleep {daemon}")
        leaf = next(
            line[3:]
            for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
            if line.startswith("0::")
        )
        assert Path(leaf).name.startswith("w-")
        assert first.stop() == 0
        assert pgrep(rf"^sleep {daemon}") == [pid]  # a graceful stop leaves the watched command's leaf alone
        second = start_serve(state, "--containment", "cgroup")
        try:
            assert wait_until_sync(lambda: bool(second.cli("events", "--json").stdout.strip()), 10.0)
            assert wait_until_sync(lambda: not pgrep(rf"^sleep {daemon}"), 10.0), second.log()
            mount = next(
                line.split()[1]
                for line in Path("/proc/self/mounts").read_text().splitlines()
                if line.split()[2] == "cgroup2"
            )
            assert not os.path.exists(mount + leaf)  # removed once empty
        finally:
            second.stop()
    finally:
        if first.proc.poll() is None:
            first.kill_hard()
        kill_leftovers(rf"^sleep {daemon}")


# ---- a run is known before it can outlive a crashed engine --------------------------------------------


def _pipeline_creates(socket_path: str, project: Path, markers: list[str]) -> None:
    """Send one ``subprocess.create`` per marker on one connection, without waiting for the answers."""
    import json
    import socket

    lines = b"".join(
        json.dumps(
            {
                "jsonrpc": "2.0",
                "method": "subprocess.create",
                "params": {"project": str(project), "command": "sleep", "args": [marker]},
                "id": n,
            }
        ).encode()
        + b"\n"
        for n, marker in enumerate(markers)
    )
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(socket_path)
    sock.sendall(lines)
    sock.close()  # the engine still reads what was sent


@pytest.mark.parametrize("containment_mode", ["process-group", "cgroup"])
def test_sigkill_of_serve_right_after_spawns_leaves_no_child(tmp_path: Path, containment_mode: str) -> None:
    """30 creates, SIGKILL of serve at a random moment within 20 ms of the first spawn, while the others are
    under way, 15 trials per mode (30 in all): the
    guardian ends what the engine started; where the guardian is killed too (every other trial), the next
    start's sweep does."""
    if containment_mode == "cgroup" and (why := cgroup_unusable()):
        pytest.skip(f"cgroup containment is not usable here: {why}")
    trials = int(os.environ.get("CRASH_TRIALS", "15"))
    rng = random.Random()
    pattern = rf"^sleep 7777\.[0-9]+{SESSION}$"
    started = 0
    try:
        for trial in range(trials):
            state, project = tmp_path / f"s{trial}", tmp_path / f"p{trial}"
            project.mkdir()
            served = start_serve(state, "--containment", containment_mode)
            markers = [mark(f"7777.{trial * 100 + n + 1}") for n in range(30)]
            _pipeline_creates(served.socket_path, project, markers)
            deadline = time.monotonic() + 5.0
            while not pgrep(pattern) and time.monotonic() < deadline:  # the first spawn is under way
                pass
            time.sleep(rng.uniform(0.0, 0.02))
            guardians = pgrep(rf"engine\._guardian import main.* {state} ")
            started += len(pgrep(pattern))
            served.kill_hard()
            if trial % 2:  # the guardian dies too: the next start's sweep is what ends them
                for pid in guardians:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                again = start_serve(state, "--containment", containment_mode)
                assert again.stop() == 0
                assert not [pid for pid in pgrep(pattern) if _in(pid, markers)], f"trial {trial}"
        assert started > 0  # the kills landed while children were being spawned
        print(f"{started} children seen just before the SIGKILLs over {trials} trials")
        assert wait_until_sync(lambda: not pgrep(pattern), 15.0), pgrep(pattern)
    finally:
        kill_leftovers(pattern)


def _in(pid: int, markers: list[str]) -> bool:
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return len(args) > 1 and args[1].decode() in markers


# ---- a full disk -------------------------------------------------------------------------------------------


def test_a_create_on_a_full_disk_fails_clearly_and_leaves_no_child(tmp_path: Path) -> None:
    """The state dir on a small tmpfs, filled: the create fails with a clear error and nothing survives."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}): run as root")
    marker = mark("7778.1")
    try:
        state, project = mount / "state", tmp_path / "p"
        project.mkdir()

        async def main() -> None:
            async with engine_at(mount, containment="process-group") as engine:
                filler = state / "filler"
                with contextlib.suppress(OSError), open(filler, "wb") as f:
                    while True:
                        f.write(b"x" * 65536)
                project_of = Project.from_directory(project)
                with pytest.raises(OSError) as failed:
                    await engine.service.create(project_of, "sleep", [marker])
                assert "No space left" in str(failed.value) or failed.value.errno == 28
                print(f"create on a full state dir: {failed.value}")
                assert not pgrep(rf"^sleep {marker}") and engine.service.ps() == []
                filler.unlink()

        trio.run(main)
        assert not pgrep(rf"^sleep {marker}")
    finally:
        kill_leftovers(rf"^sleep {marker}")
        subprocess.run(["umount", "-l", str(mount)], check=False)
