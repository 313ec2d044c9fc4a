"""Escalations that start together are driven as one batch (``engine._escalation_batch``): ``kill_all``
signals every tree in one loop, their grace periods end together, and one pass aims SIGKILL at all of
them. What must not change: every member of every tree dead and reaped when the call returns, in both
containment modes; each tree's whole grace period; force cutting a grace short; logs removed.
"""

from __future__ import annotations

import functools
import gc
import os
import resource
import time
from pathlib import Path

import pytest
import trio

from engine import RunState, SpawnSpec, SubProcessNotFoundError, open_supervisor
from engine._procfs import children_of

from .children import SESSION, kill_leftovers, mark, open_fds, pgrep, proc_exists, py, wait_until
from .service_support import engine_at, log_dir, log_paths, make_project

GRACE = 0.4


def _kinds(tag: str) -> dict[str, tuple[str, ...]]:
    """Trees of several shapes, each with a marker of its own under ``tag``."""
    return {
        # exits at once on SIGINT (the batch's driver is often this one's task: the role passes on)
        "cooperative": ("sleep", mark(f"{tag}1")),
        # ignores SIGINT, and so does its grandchild (bash starts `&` jobs with SIGINT ignored)
        "ignoring": ("bash", "-c", f"trap '' INT; sleep {mark(f'{tag}2')} & sleep {mark(f'{tag}2')}; wait"),
        # exits during the grace period, a while after SIGINT
        "slow exit": ("bash", "-c", f"trap 'sleep 0.1; exit 3' INT; sleep {mark(f'{tag}3')} & wait"),
        # leaves its grandchild in the background, outside the group, and exits during the grace
        "escapee": (
            "bash",
            "-c",
            f"trap 'exit 0' INT; setsid bash -c \"trap '' INT; exec sleep {mark(f'{tag}4')}\" & "
            f"sleep {mark(f'{tag}5')} & wait",
        ),
    }


@pytest.mark.serial  # a time bound: measured alone (make test runs the rest two at a time)
async def test_kill_all_of_many_mixed_trees_leaves_nothing(tmp_path: Path, containment: str) -> None:
    """40 trees of four shapes, grandchildren included: all gone and reaped when kill_all returns, every
    log removed, within the grace plus the kill wait's first steps."""
    tag = "331."
    pattern = rf"sleep 331\.[0-9]{SESSION}"
    project = make_project(tmp_path)
    try:
        async with engine_at(
            tmp_path, grace_seconds=GRACE, containment=containment, max_processes_per_project=100
        ) as engine:
            service = engine.service
            records = []
            for _ in range(10):
                for argv in _kinds(tag).values():
                    records.append(await service.create(project, argv[0], list(argv[1:])))
            await wait_until(lambda: len(pgrep(pattern)) >= 50)
            pids = [sp.pid for sp in records] + pgrep(pattern)
            t0 = time.monotonic()
            assert await service.kill_all() is True
            elapsed = time.monotonic() - t0
            assert not pgrep(pattern)
            assert not [pid for pid in pids if proc_exists(pid)]  # not even a zombie
            assert service.ps() == []
            assert os.listdir(log_dir(project)) == [".gitignore"]
            assert not [path for sp in records for path in log_paths(sp) if os.path.exists(path)]
            assert elapsed < GRACE + 2.0, elapsed
            ignoring = [sp for sp in records if sp.exit is not None and sp.exit.escalated]
            assert len(ignoring) >= 10  # at least the SIGINT-ignoring ones needed SIGKILL
    finally:
        kill_leftovers(pattern)


async def test_each_tree_of_a_batch_gets_its_whole_grace(tmp_path: Path, containment: str) -> None:
    """Aligned deadlines move a grace period's end later, never earlier: each child notes when SIGINT
    came and keeps noting the time until SIGKILL ends it."""
    n = 30
    marker = mark("332.1")
    code = (  # os.write: a handler writing through the file object the loop uses may hit a reentrant call
        "import os,signal,time,sys\n"
        "fd=os.open(sys.argv[1],os.O_WRONLY|os.O_CREAT|os.O_APPEND)\n"
        "signal.signal(signal.SIGINT, lambda s,fr: os.write(fd, f'int {time.monotonic()}\\n'.encode()))\n"
        "os.write(fd, b'ready\\n')\n"
        "while True:\n    os.write(fd, f't {time.monotonic()}\\n'.encode()); time.sleep(0.005)\n"
    )
    files = [tmp_path / f"child-{i}.txt" for i in range(n)]
    try:
        async with open_supervisor(
            grace_seconds=GRACE, kill_wait_seconds=2.0, containment=containment
        ) as sup:
            runs = [
                await sup.spawn(SpawnSpec(argv=(*py(code), str(path), marker), scope_key="batch"))
                for path in files
            ]
            await wait_until(lambda: all(p.exists() and "ready" in p.read_text() for p in files))
            exits = await sup.cancel_scope("batch")
            assert all(e.escalated for e in exits)
            assert all(run.state is RunState.EXITED and not proc_exists(run.pid) for run in runs)
        for path in files:
            lines = path.read_text().split("\n")
            sigint = min(float(line.split()[1]) for line in lines if line.startswith("int "))
            last = max(float(line.split()[1]) for line in lines if line.startswith("t "))
            assert last - sigint >= GRACE - 0.05, (path.name, last - sigint)
    finally:
        kill_leftovers(marker)


@pytest.mark.serial  # a time bound: measured alone (make test runs the rest two at a time)
async def test_force_cuts_one_member_s_grace_short_and_the_rest_keep_theirs(
    tmp_path: Path, containment: str
) -> None:
    """A force request wakes the batch's driver for that member only: it is killed at once, while the
    others of the batch wait out their grace (30 s here) until they are forced too."""
    marker = mark("333.1")
    try:
        async with open_supervisor(grace_seconds=30.0, kill_wait_seconds=2.0, containment=containment) as sup:
            runs = [
                await sup.spawn(
                    SpawnSpec(argv=("bash", "-c", f"trap '' INT; exec sleep {marker}"), scope_key="f")
                )
                for _ in range(5)
            ]
            await wait_until(lambda: len(pgrep(rf"^sleep {marker}")) == 5)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sup.cancel_scope, "f")
                await trio.sleep(0.3)  # every escalation is in its grace period
                t0 = time.monotonic()
                first = await sup.cancel(runs[2], force=True)
                assert time.monotonic() - t0 < 2.0
                assert first.escalated and first.signal == 9
                assert all(run.exit is None for i, run in enumerate(runs) if i != 2)  # still in their grace
                assert len(pgrep(rf"^sleep {marker}")) == 4
                t0 = time.monotonic()
                for run in runs:
                    await sup.cancel(run, force=True)
                assert time.monotonic() - t0 < 2.0
            assert not pgrep(rf"^sleep {marker}")
            assert not [run.pid for run in runs if proc_exists(run.pid)]
    finally:
        kill_leftovers(marker)


@pytest.mark.serial  # a time bound: measured alone (make test runs the rest two at a time)
async def test_a_leader_that_exits_in_the_grace_leaves_its_tree_to_its_own_task(
    tmp_path: Path, containment: str
) -> None:
    """The batch waits on leaders' pidfds; a leader that exits while a grandchild ignoring SIGINT lives on
    hands its tree back to its own task, which kills the grandchild at the end of the grace."""
    marker = mark("334.1")
    try:
        async with open_supervisor(
            grace_seconds=GRACE, kill_wait_seconds=2.0, containment=containment
        ) as sup:
            runs = [
                await sup.spawn(
                    SpawnSpec(
                        argv=("bash", "-c", f"trap 'exit 0' INT; (trap '' INT; exec sleep {marker}) & wait"),
                        scope_key="h",
                    )
                )
                for _ in range(4)
            ]
            runs.append(await sup.spawn(SpawnSpec(argv=("sleep", marker), scope_key="h")))
            await wait_until(lambda: len(pgrep(rf"^sleep {marker}")) == 5)
            t0 = time.monotonic()
            exits = await sup.cancel_scope("h")
            elapsed = time.monotonic() - t0
            assert not pgrep(rf"^sleep {marker}")
            assert not [run.pid for run in runs if proc_exists(run.pid)]
            assert [e.escalated for e in exits] == [True] * 4 + [False]
            assert GRACE - 0.05 <= elapsed < GRACE + 2.0, elapsed
    finally:
        kill_leftovers(marker)


async def test_kill_all_of_a_hundred_and_twenty_mixed_trees_leaves_nothing(
    tmp_path: Path, containment: str
) -> None:
    """120 trees, half of them ignoring SIGINT, in one batch: nothing of them is left, every log goes, and
    the engine leaves the host's garbage collector as it found it (it never switches it off)."""
    pattern = rf"sleep 335\.[12]{SESSION}"
    project = make_project(tmp_path)
    was = gc.isenabled()
    try:
        async with engine_at(
            tmp_path, containment=containment, max_processes=200, max_processes_per_project=200
        ) as engine:
            service = engine.service
            records = [
                await service.create(project, "sleep", [mark("335.1")])
                if i % 2
                else await service.create(project, "bash", ["-c", f"trap '' INT; exec sleep {mark('335.2')}"])
                for i in range(120)
            ]
            await wait_until(lambda: len(pgrep(pattern)) == 120)
            assert await service.kill_all() is True
            assert gc.isenabled() is was
            assert not pgrep(pattern)
            assert not [sp.pid for sp in records if proc_exists(sp.pid)]
            assert os.listdir(log_dir(project)) == [".gitignore"]
    finally:
        kill_leftovers(pattern)


def _populated(leaf: str) -> bool:
    """Whether the cgroup leaf holds a process (``populated 1``); a leaf already removed holds none."""
    try:
        return "populated 1" in Path(leaf, "cgroup.events").read_text()
    except FileNotFoundError:
        return False


async def test_kill_all_of_many_sigint_ignoring_children_releases_everything_before_it_returns(
    tmp_path: Path, containment: str
) -> None:
    """``kill_all`` of 150 SIGINT-ignoring children (one waiting task, the logs deleted by a worker thread
    during the grace, the runs ended by the batch's driver): when it returns every
    process is reaped, every log deleted, every leaf empty (and removed right after, by the housekeeping),
    and nothing carries the test's marker."""
    marker = mark("336.1")
    project = make_project(tmp_path)
    try:
        async with engine_at(
            tmp_path,
            grace_seconds=0.2,
            containment=containment,
            max_processes=200,
            max_processes_per_project=200,
        ) as engine:
            service = engine.service
            records = [
                await service.create(project, "bash", ["-c", f"trap '' INT; exec sleep {marker}"])
                for _ in range(150)
            ]
            await wait_until(lambda: len(pgrep(rf"^sleep {marker}")) == 150)
            leaves = [sp._run.cgroup for sp in records]
            paths = [path for sp in records for path in log_paths(sp)]
            assert await service.kill_all() is True
            assert not pgrep(rf"^sleep {marker}")
            assert not [sp.pid for sp in records if proc_exists(sp.pid)]  # reaped, not even a zombie
            assert not [path for path in paths if os.path.exists(path)]
            assert os.listdir(log_dir(project)) == [".gitignore"]
            assert not [leaf for leaf in leaves if leaf is not None and _populated(leaf)]
            # Removed after kill_all returns (a worker thread's rmdir of 150: some 5-10 ms, more under load).
            await wait_until(lambda: not [leaf for leaf in leaves if leaf and os.path.exists(leaf)])
            assert all(sp.exit is not None and sp.exit.escalated for sp in records)
            assert service.ps() == []
    finally:
        kill_leftovers(marker)


async def test_a_kill_all_overlapping_a_halt_ends_both_and_keeps_no_log(
    tmp_path: Path, containment: str
) -> None:
    """A halt under way when ``kill_all`` starts: the halt answers that its record was killed (its logs are
    deleted, nothing is kept), the others' logs go too, and every process is reaped."""
    marker = mark("336.2")
    project = make_project(tmp_path)
    try:
        async with engine_at(tmp_path, grace_seconds=0.3, containment=containment) as engine:
            service = engine.service
            records = [
                await service.create(project, "bash", ["-c", f"trap '' INT; exec sleep {marker}"])
                for _ in range(6)
            ]
            await wait_until(lambda: len(pgrep(rf"^sleep {marker}")) == 6)
            paths = [path for sp in records for path in log_paths(sp)]
            halted: list[BaseException] = []

            async def halt() -> None:
                try:
                    await service.halt_subprocess(records[0])
                except SubProcessNotFoundError as exc:
                    halted.append(exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(halt)
                await trio.sleep(0.05)  # the halt is in its grace period
                assert await service.kill_all() is True
            assert len(halted) == 1 and "killed while it was being halted" in str(halted[0])
            assert not pgrep(rf"^sleep {marker}")
            assert not [sp.pid for sp in records if proc_exists(sp.pid)]
            assert not [path for path in paths if os.path.exists(path)]
            assert service.ps() == []
    finally:
        kill_leftovers(marker)


async def test_children_that_exit_on_their_own_during_a_kill_all_are_ended_with_the_rest(
    tmp_path: Path, containment: str
) -> None:
    """Children that exit on their own during the grace (their tree leaves with the leader) and others that
    need SIGKILL, in one ``kill_all``: all reaped, every log deleted, each exit as it happened."""
    marker = mark("336.3")
    project = make_project(tmp_path)
    try:
        async with engine_at(tmp_path, grace_seconds=0.5, containment=containment) as engine:
            service = engine.service
            quitting = [
                await service.create(
                    project, "bash", ["-c", f"trap '' INT; sleep {marker} & sleep 0.2; exit 7"]
                )
                for _ in range(10)
            ]
            ignoring = [
                await service.create(project, "bash", ["-c", f"trap '' INT; exec sleep {marker}"])
                for _ in range(10)
            ]
            await wait_until(lambda: len(pgrep(rf"^sleep {marker}")) == 20)
            paths = [path for sp in quitting + ignoring for path in log_paths(sp)]
            assert await service.kill_all() is True
            assert not pgrep(rf"^sleep {marker}")
            assert not [sp.pid for sp in quitting + ignoring if proc_exists(sp.pid)]
            assert not [path for path in paths if os.path.exists(path)]
            assert all(sp.exit is not None and sp.exit.exit_code == 7 for sp in quitting)
            assert all(sp.exit is not None and sp.exit.escalated for sp in ignoring)
    finally:
        kill_leftovers(marker)


async def test_trees_that_keep_forking_during_a_kill_all_leave_nothing(
    tmp_path: Path, containment: str
) -> None:
    """Trees that fork a SIGINT-ignoring child every few milliseconds, in a batch with others: a child
    forked while the first SIGKILL was aimed (in cgroup mode, at the pids read from the leaf) is ended by
    the kill that follows the leader's exit; nothing is left when ``kill_all`` returns."""
    marker = mark("336.4")
    project = make_project(tmp_path)
    forking = f"trap '' INT; while :; do (trap '' INT; exec sleep {marker}) & sleep 0.003; done"
    try:
        async with engine_at(tmp_path, grace_seconds=0.2, containment=containment) as engine:
            service = engine.service
            records = [await service.create(project, "bash", ["-c", forking]) for _ in range(4)]
            records += [
                await service.create(project, "bash", ["-c", f"trap '' INT; exec sleep {marker}"])
                for _ in range(20)
            ]
            await wait_until(lambda: len(pgrep(rf"^sleep {marker}")) >= 40)
            assert await service.kill_all() is True
            assert not pgrep(rf"^sleep {marker}")
            assert not [sp.pid for sp in records if proc_exists(sp.pid)]
    finally:
        kill_leftovers(marker)


@pytest.mark.serial  # a time bound: measured alone (make test runs the rest two at a time)
async def test_a_batch_kills_a_sigint_ignoring_grandchild_with_its_leader_not_after_the_kill_wait(
    tmp_path: Path, containment: str
) -> None:
    """Trees whose leader and grandchild both ignore SIGINT, ended in one batch whose runs its driver ends
    (their tasks gone during the grace): the grandchild dies right after its leader (in cgroup mode the
    first SIGKILL goes to the leader alone, the leaf's ``cgroup.kill`` once the leader is reaped), long
    before the 30 s kill wait; every exit is recorded, escalated."""
    marker = mark("337.1")
    try:
        async with open_supervisor(
            grace_seconds=GRACE, kill_wait_seconds=30.0, containment=containment
        ) as sup:
            runs = [
                await sup.spawn(
                    SpawnSpec(
                        argv=(
                            "bash",
                            "-c",
                            f"trap '' INT; (trap '' INT; exec sleep {marker}) & sleep {marker}",
                        ),
                        scope_key="g",
                    )
                )
                for _ in range(6)
            ]
            await wait_until(lambda: len(pgrep(rf"^sleep {marker}")) == 12)
            t0 = time.monotonic()
            await sup.cancel_many(runs)
            elapsed = time.monotonic() - t0
            assert not pgrep(rf"^sleep {marker}")
            assert not [run.pid for run in runs if proc_exists(run.pid)]
            assert all(run.state is RunState.EXITED for run in runs)
            assert all(run.exit is not None and run.exit.escalated and not run.exit.survivors for run in runs)
            assert GRACE - 0.05 <= elapsed < GRACE + 3.0, elapsed
    finally:
        kill_leftovers(marker)


async def test_runs_a_batch_driver_ends_are_told_to_their_waiters_and_observers(
    tmp_path: Path, containment: str
) -> None:
    """A run of a batch is ended by the driver, not by its own task: ``wait()`` of each returns its exit,
    ``on_leader_exit`` hooks run, and the observers hear of every end once."""
    marker = mark("337.2")
    ended: list[int] = []

    class Observer:
        def run_started(self, run: object) -> None:
            pass

        def run_ended(self, run: object) -> None:
            ended.append(getattr(run, "pid", -1))

    try:
        async with open_supervisor(
            grace_seconds=GRACE, kill_wait_seconds=5.0, containment=containment
        ) as sup:
            sup.add_observer(Observer())
            runs = [
                await sup.spawn(
                    SpawnSpec(argv=("bash", "-c", f"trap '' INT; exec sleep {marker}"), scope_key="o")
                )
                for _ in range(8)
            ]
            hooked: list[int] = []
            for run in runs:
                run.on_leader_exit(functools.partial(hooked.append, run.pid))
            await wait_until(lambda: len(pgrep(rf"^sleep {marker}")) == 8)
            waited: list[int] = []

            async def wait_for(i: int) -> None:
                exit = await runs[i].wait()
                assert exit.escalated
                waited.append(i)

            async with trio.open_nursery() as nursery:
                for i in range(len(runs)):
                    nursery.start_soon(wait_for, i)
                exits = await sup.cancel_scope("o")
            assert sorted(waited) == list(range(8))
            assert [e.escalated for e in exits] == [True] * 8
            assert sorted(hooked) == sorted(run.pid for run in runs)
            assert sorted(ended) == sorted(run.pid for run in runs)
            assert not pgrep(rf"^sleep {marker}")
    finally:
        kill_leftovers(marker)


async def test_a_kill_all_ends_the_log_cap_during_the_grace_and_the_next_create_has_one_again(
    tmp_path: Path, containment: str
) -> None:
    """``kill_all`` deletes every log during the grace and then ends the log cap (with its watches, whose
    ``IN_IGNORED`` it would otherwise read among the kills); a create afterwards starts a new cap, which
    still keeps that child's log within ``log_cap_bytes``. A ``kill_project`` that leaves another project's
    child keeps the cap running for it."""
    marker = mark("338.1")
    project = make_project(tmp_path)
    other = make_project(tmp_path, "other")
    cap = 64 * 1024
    try:
        async with engine_at(
            tmp_path, grace_seconds=0.2, containment=containment, log_cap_bytes=cap
        ) as engine:
            service = engine.service
            for _ in range(6):
                await service.create(project, "bash", ["-c", f"trap '' INT; exec sleep {marker}"])
            await wait_until(lambda: len(pgrep(rf"^sleep {marker}")) == 6)
            assert service._capper is not None
            assert await service.kill_all() is True
            assert service._capper is None
            kept = await service.create(other, "bash", ["-c", f"exec sleep {marker}"])
            assert service._capper is not None
            await service.kill_project(project.id)  # nothing of it left: the other's cap stays
            assert service._capper is not None
            await service.kill_subprocess(kept)
            loud = await service.create(
                project, "bash", ["-c", f"yes | head -c {16 * cap}; exec sleep {marker}"]
            )

            async def capped() -> bool:
                return (await service.read_log(loud.pid, "stdout", tail=1)).dropped_bytes > 0

            await wait_until(capped, seconds=10, interval=0.05)
            assert await service.kill_all() is True
    finally:
        kill_leftovers(marker)


async def test_a_scrubbed_setsid_child_forked_late_in_the_grace_is_killed_with_its_leader(
    tmp_path: Path, containment: str
) -> None:
    """Leaders that, on SIGINT, wait a while (the batch has made its looks' descriptors ahead by then) and
    then start a child in a session of its own with an empty environment: no group, no marker. The look at
    each leader's children just before its SIGKILL finds it (in process-group mode nothing else could
    attribute it once its leader is dead; in cgroup mode its leaf holds it): ``kill_all`` leaves nothing."""
    marker = mark("336.7")
    project = make_project(tmp_path)
    script = f"trap 'sleep 0.1; setsid env -i sleep {marker} & ' INT; while :; do sleep 0.01; done"
    try:
        async with engine_at(tmp_path, grace_seconds=0.4, containment=containment) as engine:
            service = engine.service
            records = [await service.create(project, "bash", ["-c", script]) for _ in range(6)]
            # each bash has set its trap once its loop has started a sleep
            await wait_until(lambda: all(children_of(sp.pid) for sp in records))
            assert await service.kill_all() is True
            assert not pgrep(rf"^sleep {marker}")
            assert not [sp.pid for sp in records if proc_exists(sp.pid)]
            assert all(sp.exit is not None and sp.exit.escalated for sp in records)
    finally:
        kill_leftovers(marker)


async def test_a_kill_all_closes_every_descriptor_its_batch_opened(tmp_path: Path, containment: str) -> None:
    """The descriptors a batch opens on the leaders' ``/proc`` files or the leaves' ``cgroup.events``
    during the grace (to look at them for less after it) are closed by the time ``kill_all`` returns, with
    the pidfds: as many open descriptors after as before the runs were created."""
    marker = mark("336.8")
    project = make_project(tmp_path)
    try:
        async with engine_at(tmp_path, grace_seconds=0.2, containment=containment) as engine:
            service = engine.service
            await service.kill_all()  # the folder cache and the log cap as they are between kill_alls
            gc.collect()
            before = open_fds()
            records = [
                await service.create(project, "bash", ["-c", f"trap '' INT; exec sleep {marker}"])
                for _ in range(20)
            ]
            await wait_until(lambda: len(pgrep(rf"^sleep {marker}")) == 20)
            assert open_fds() > before
            assert await service.kill_all() is True
            assert not [sp.pid for sp in records if proc_exists(sp.pid)]
            gc.collect()
            await wait_until(lambda: open_fds() <= before)
    finally:
        kill_leftovers(marker)


async def test_a_kill_all_with_few_descriptors_to_spare_still_ends_everything(
    tmp_path: Path, containment: str
) -> None:
    """Under a low ``RLIMIT_NOFILE`` the batch makes its looks' descriptors ahead for as many members as
    leave 512 free (here a few), and looks by path at the others: every tree still ends, nothing fails
    for want of a descriptor, and every descriptor is closed again."""
    marker = mark("336.9")
    project = make_project(tmp_path)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        async with engine_at(tmp_path, grace_seconds=0.2, containment=containment) as engine:
            service = engine.service
            records = [
                await service.create(project, "bash", ["-c", f"trap '' INT; exec sleep {marker}"])
                for _ in range(30)
            ]
            await wait_until(lambda: len(pgrep(rf"^sleep {marker}")) == 30)
            before = open_fds()
            resource.setrlimit(resource.RLIMIT_NOFILE, (before + 512 + 10, hard))  # 5 members' worth
            assert await service.kill_all() is True
            assert not pgrep(rf"^sleep {marker}")
            assert not [sp.pid for sp in records if proc_exists(sp.pid)]
            assert all(sp.exit is not None and sp.exit.escalated for sp in records)
            assert open_fds() < before
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        kill_leftovers(marker)


async def test_the_leaves_of_a_batch_are_removed_after_its_callers_go_on(
    tmp_path: Path, needs_cgroup: None
) -> None:
    """The leaves of the runs a ``kill_all`` ended are not removed in the driver's passes, among the kills:
    every leaf is seen empty before the call returns, the observers hear of the ends while the leaves are
    still there, and the leaves are removed right after, by the housekeeping; the engine's close leaves
    none."""
    marker = mark("336.10")
    project = make_project(tmp_path)
    present_when_told: list[bool] = []

    class Observer:
        def run_started(self, run: object) -> None:
            pass

        def run_ended(self, run: object) -> None:
            leaf = getattr(run, "cgroup", None)
            present_when_told.append(leaf is not None and os.path.isdir(leaf))

    try:
        async with engine_at(tmp_path, grace_seconds=0.2, containment="cgroup") as engine:
            engine.supervisor.add_observer(Observer())
            records = [
                await engine.service.create(project, "bash", ["-c", f"trap '' INT; exec sleep {marker}"])
                for _ in range(20)
            ]
            leaves = [sp._run.cgroup for sp in records]
            assert all(leaf is not None and os.path.isdir(leaf) for leaf in leaves)
            await wait_until(lambda: len(pgrep(rf"^sleep {marker}")) == 20)
            assert await engine.service.kill_all() is True  # every leaf seen empty
            assert not pgrep(rf"^sleep {marker}")
            assert present_when_told == [True] * 20

            def left() -> list[str]:
                return [leaf for leaf in leaves if leaf is not None and os.path.exists(leaf)]

            with trio.fail_after(10):
                await wait_until(lambda: not left())
        assert not left()
    finally:
        kill_leftovers(marker)
