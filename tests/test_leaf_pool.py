"""Empty cgroup leaves kept for the next runs (``engine/_leaf_pool.py``): a run is born in a leaf that no
other run holds, an ended run's empty leaf serves the next one (its CPU counted from the new run's start),
a leaf that still holds a process or memory is removed instead, the spare leaves go with the engine, and
the guardian and the sweep remove them."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import trio

from engine import EngineConfig, Project, SpawnSpec, open_engine, open_supervisor
from engine._cgroup import EngineCgroup, Leaf, load_recorded_parent
from engine._containment import CgroupContainment, open_containment
from engine._leaf_pool import LeafPool
from engine._sweep import sweep_records, unwatched_leaves
from engine.server._stats import RunStats

from .test_cgroup import _FOUND, needs_cgroup

pytestmark = needs_cgroup


def _spares(path: str) -> list[str]:
    return sorted(
        name for name in os.listdir(path) if name.startswith("p") and os.path.isdir(os.path.join(path, name))
    )


async def _leaf_back_in_pool(chosen: CgroupContainment, path: str) -> None:
    with trio.fail_after(5):  # the housekeeping follows the waiters
        while path not in {leaf.path for leaf in chosen.pool._spare}:
            await trio.sleep(0.01)


async def test_runs_take_spare_leaves_and_give_them_back_and_close_removes_them(tmp_path: Path) -> None:
    async with open_containment("cgroup", state_dir=str(tmp_path)) as chosen:
        assert isinstance(chosen, CgroupContainment)
        parent = chosen.cgroup.path
        async with open_supervisor(containment=chosen, grace_seconds=0.3) as sup:
            first = await sup.spawn(SpawnSpec(argv=("true",)))
            assert first.cgroup is not None and os.path.basename(first.cgroup).startswith("r")
            await first.wait()
            await _leaf_back_in_pool(chosen, first.cgroup)  # empty once it ended: kept, not removed
            assert os.path.isdir(first.cgroup)
            second = await sup.spawn(SpawnSpec(argv=("sh", "-c", "cat /proc/self/cgroup")))
            assert second.cgroup == first.cgroup  # born in the leaf the first run gave back
            assert second.leaf is not None and second.leaf.populated()
            # Two at once: the second one held its leaf, so the third is born in another.
            third = await sup.spawn(SpawnSpec(argv=("sleep", "30")))
            assert third.cgroup is not None and third.cgroup != second.cgroup
            await second.wait()
            await sup.cancel(third)
            watched = await sup.spawn(SpawnSpec(argv=("true",), outlive_engine_crash=True))
            assert watched.cgroup is not None and os.path.basename(watched.cgroup).startswith("w-")
            await sup.cancel(watched)
            with trio.fail_after(5):
                while os.path.exists(watched.cgroup):  # a watched command's leaf is never kept
                    await trio.sleep(0.01)
            assert watched.cgroup not in {leaf.path for leaf in chosen.pool._spare}
        assert len(chosen.cgroup.leaves()) == chosen.pool.size
    assert not os.path.exists(parent)  # the spares went with the engine, then the parent


async def test_a_reused_leaf_counts_cpu_from_its_new_runs_start(tmp_path: Path) -> None:
    burn = "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done"
    (tmp_path / "project").mkdir()
    project = Project.from_directory(tmp_path / "project")
    config = EngineConfig(state_dir=str(tmp_path / "state"), containment="cgroup", grace_seconds=0.3)
    async with open_engine(config) as engine:
        chosen = engine.supervisor.containment
        assert isinstance(chosen, CgroupContainment)
        busy = await engine.service.create(project, "sh", ["-c", burn])
        with trio.fail_after(60):
            await busy.wait()
        assert busy._run is not None and busy._run.cgroup is not None and busy._run.leaf is not None
        used = busy._run.leaf.cpu_usec()
        assert used is not None and used > 100_000  # the loop's CPU, in microseconds
        await _leaf_back_in_pool(chosen, busy._run.cgroup)
        idle = await engine.service.create(project, "sleep", ["30"])
        assert idle._run is not None and idle._run.cgroup == busy._run.cgroup and idle._run.leaf is not None
        assert idle._run.leaf.cpu_base_usec >= used  # the leaf's counter goes on from the busy run's
        now = idle._run.leaf.cpu_usec()
        assert now is not None and now < 50_000  # a sleep's own, not the loop's
        (row,) = [row for row in await RunStats(engine).collect() if row["pid"] == idle.pid]
        assert isinstance(row["cpu_seconds"], float) and row["cpu_seconds"] < 0.05  # what a viewer is shown
        await engine.service.kill_all()


async def test_a_leaf_that_got_its_cgroup_kill_never_serves_another_run(tmp_path: Path) -> None:
    """After a ``cgroup.kill``, this kernel kills every child cloned into the leaf at birth: the next run
    would die at once (found with a halt that a kill overtook)."""
    async with open_containment("cgroup", state_dir=str(tmp_path)) as chosen:
        assert isinstance(chosen, CgroupContainment)
        async with open_supervisor(containment=chosen, grace_seconds=0.2) as sup:
            for force in (True, False):  # a kill at once, and SIGINT ignored: SIGKILL after the grace
                doomed = await sup.spawn(SpawnSpec(argv=("sh", "-c", "trap '' INT; sleep 30")))
                await trio.sleep(0.1)  # the trap is set
                await sup.cancel(doomed, force=force)
                assert doomed.cgroup is not None
                with trio.fail_after(5):
                    while os.path.exists(doomed.cgroup):  # removed, not kept
                        await trio.sleep(0.01)
                after = await sup.spawn(SpawnSpec(argv=("sleep", "30")))
                assert after.cgroup != doomed.cgroup
                await trio.sleep(0.2)
                assert after.exit is None  # alive: not killed at its birth
                await sup.cancel(after, force=True)


async def test_a_leaf_that_holds_a_process_or_the_pool_is_full_is_removed(tmp_path: Path) -> None:
    assert _FOUND is not None
    cgroup = EngineCgroup.open(_FOUND, str(tmp_path))
    pool = LeafPool(cgroup, "abc123", size=1)
    busy = cgroup.leaf("r1-abc123")
    empty = [cgroup.leaf("r2-abc123"), cgroup.leaf("r3-abc123")]
    child = subprocess.Popen(["sleep", "30"])
    try:
        with open(os.path.join(busy.path, "cgroup.procs"), "w") as procs:
            procs.write(str(child.pid))
        assert busy.populated()
        assert busy.reusable() is None
        assert pool.recycle([busy, *empty]) == [False, True, False]  # room for one; the busy one: no
        assert pool.take("r9-abc123").path == empty[0].path
        watched = cgroup.leaf("w-4-abc123")
        assert pool.recycle([watched]) == [False]  # never a watched command's leaf
        pool.close()
        assert pool.recycle([empty[1]]) == [False]  # closed: keeps nothing
    finally:
        child.kill()
        child.wait()
        for leaf in cgroup.leaves():
            leaf.remove()
        cgroup.close()


def test_a_leaf_charged_memory_is_not_reused(tmp_path: Path) -> None:
    # The decision reads the leaf's interface files; a folder with the same files stands in for a leaf
    # with the memory controller on (this machine's may have none).
    folder = tmp_path / "r5-abc123"
    folder.mkdir()
    (folder / "cgroup.events").write_text("populated 0\nfrozen 0\n")
    (folder / "cpu.stat").write_text("usage_usec 1234\nuser_usec 1000\nsystem_usec 234\n")
    leaf = Leaf(path=str(folder), rel="/x/r5-abc123")
    (folder / "memory.current").write_text("8192\n")
    assert leaf.reusable() is None  # page cache still charged to it: removed, not reused
    (folder / "memory.current").write_text("0\n")
    reused = leaf.reusable()
    assert reused is not None and reused.cpu_base_usec == 1234 and reused.cpu_usec() == 0
    (folder / "cpu.stat").write_text("usage_usec 1534\n")
    assert reused.cpu_usec() == 300
    (folder / "cgroup.events").write_text("populated 1\nfrozen 0\n")
    assert leaf.reusable() is None


async def test_spare_leaves_left_by_a_crash_are_removed_by_the_sweep(tmp_path: Path) -> None:
    assert _FOUND is not None
    cgroup = EngineCgroup.open(_FOUND, str(tmp_path))  # as an engine that then dies: nothing closed
    pool = LeafPool(cgroup, "abc123")
    pool.fill()
    recorded = load_recorded_parent(str(tmp_path))
    assert recorded is not None
    assert sorted(os.path.basename(leaf.path) for leaf in unwatched_leaves(*recorded)) == [
        "p1-abc123",
        "p2-abc123",
    ]
    sweep_records(str(tmp_path), grace_seconds=0.1, kill_wait_seconds=0.5)
    assert _spares(cgroup.path) == []
    cgroup.close()
    assert not os.path.exists(cgroup.path)


@pytest.mark.parametrize("size", [0, 1])
def test_a_pool_without_spares_makes_the_leaf_itself(tmp_path: Path, size: int) -> None:
    assert _FOUND is not None
    cgroup = EngineCgroup.open(_FOUND, str(tmp_path))
    pool = LeafPool(cgroup, "abc123", size=size)
    try:
        pool.fill()
        leaf = pool.take("r7-abc123")
        assert os.path.basename(leaf.path) == ("p1-abc123" if size else "r7-abc123")
        assert pool.take("r8-abc123").path.endswith("r8-abc123")  # none left: made
        for made in cgroup.leaves():
            made.remove()
        pool.fill()
        pool.close()
        assert cgroup.leaves() == []
        pool.fill()  # closed: makes nothing
        assert cgroup.leaves() == []
    finally:
        cgroup.close()
