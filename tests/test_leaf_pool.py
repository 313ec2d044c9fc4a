"""Empty cgroup leaves made ahead for the next runs (``engine/_leaf_pool.py``): a run is still born in a
leaf of its own, never one an earlier run used, the spare leaves go with the engine, and the guardian and
the sweep remove them."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import trio

from engine import SpawnSpec, open_supervisor
from engine._cgroup import EngineCgroup, load_recorded_parent
from engine._containment import CgroupContainment, open_containment
from engine._leaf_pool import LeafPool
from engine._sweep import sweep_records, unwatched_leaves

from .test_cgroup import _FOUND, needs_cgroup

pytestmark = needs_cgroup


def _spares(path: str) -> list[str]:
    return sorted(
        name for name in os.listdir(path) if name.startswith("p") and os.path.isdir(os.path.join(path, name))
    )


async def test_runs_take_spare_leaves_made_after_a_run_and_close_removes_them(tmp_path: Path) -> None:
    async with open_containment("cgroup", state_dir=str(tmp_path)) as chosen:
        assert isinstance(chosen, CgroupContainment)
        parent = chosen.cgroup.path
        async with open_supervisor(containment=chosen, grace_seconds=0.3) as sup:
            first = await sup.spawn(SpawnSpec(argv=("true",)))
            assert first.cgroup is not None and os.path.basename(first.cgroup).startswith("r")
            await first.wait()
            with trio.fail_after(5):
                while len(_spares(parent)) < chosen.pool.size:  # the housekeeping follows the waiters
                    await trio.sleep(0.01)
            spares = _spares(parent)
            assert len(spares) == chosen.pool.size  # made in the housekeeping after the run
            second = await sup.spawn(SpawnSpec(argv=("sh", "-c", "cat /proc/self/cgroup")))
            assert second.cgroup is not None and os.path.basename(second.cgroup) in spares  # born there
            await second.wait()
            with trio.fail_after(5):
                while os.path.exists(second.cgroup):  # one run per leaf: removed when it ended
                    await trio.sleep(0.01)
            watched = await sup.spawn(SpawnSpec(argv=("true",), outlive_engine_crash=True))
            assert watched.cgroup is not None and os.path.basename(watched.cgroup).startswith("w-")
            await sup.cancel(watched)
        assert _spares(parent) != []
    assert not os.path.exists(parent)  # the spares went with the engine, then the parent


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


def _own_leaf_file(mount: str, name: str) -> str:
    """A shell expression: the path of ``name`` in the shell's own cgroup leaf."""
    return f'"{mount}$(sed -n "s/^0:://p" /proc/self/cgroup)/{name}"'


async def test_what_a_run_does_to_its_leaf_never_reaches_the_next_runs(tmp_path: Path) -> None:
    """A run can write its own leaf's ``cgroup.kill`` (the kernel then kills every child later cloned
    into that leaf at birth) or ``cgroup.freeze`` (a clone into it would block the engine): a leaf
    serves one run, so the runs after it are born alive and the engine goes on (found when leaves were
    reused, in review)."""
    async with open_containment("cgroup", state_dir=str(tmp_path)) as chosen:
        assert isinstance(chosen, CgroupContainment)
        mount = chosen.cgroup.cgroup2.mount
        async with open_supervisor(containment=chosen, grace_seconds=0.2) as sup:
            killer = await sup.spawn(
                SpawnSpec(argv=("sh", "-c", f"echo 1 > {_own_leaf_file(mount, 'cgroup.kill')}; sleep 30"))
            )
            with trio.fail_after(10):
                ended = await killer.wait()
            assert ended.signal == signal.SIGKILL  # by its own hand: the engine sent nothing
            freezer = await sup.spawn(
                SpawnSpec(argv=("sh", "-c", f"echo 1 > {_own_leaf_file(mount, 'cgroup.freeze')}; sleep 30"))
            )
            assert freezer.cgroup is not None
            events = os.path.join(freezer.cgroup, "cgroup.events")
            with trio.fail_after(10):
                while "frozen 1" not in Path(events).read_text():
                    await trio.sleep(0.01)
            os.kill(freezer.pid, signal.SIGKILL)  # from outside, as an agent ends a process that hangs
            with trio.fail_after(10):
                await freezer.wait()
            # Should a frozen leaf ever serve a spawn again, the spawn blocks this thread in the kernel:
            # thawed from a timer thread, so that the test fails instead of hanging the suite.
            freezer_leaf = Path(freezer.cgroup, "cgroup.freeze")
            thaw = threading.Timer(10, lambda: freezer_leaf.write_text("0"))
            thaw.start()
            try:
                for n in range(3):
                    started = time.monotonic()
                    after = await sup.spawn(SpawnSpec(argv=("sleep", "30")))
                    assert time.monotonic() - started < 5
                    assert after.cgroup not in (killer.cgroup, freezer.cgroup)
                    await trio.sleep(0.2)
                    assert after.exit is None, (n, after.exit)  # alive: not killed at its birth
                    await sup.cancel(after, force=True)
            finally:
                thaw.cancel()


async def test_after_a_cgroup_kill_of_the_parent_the_spare_leaves_serve_the_next_runs(tmp_path: Path) -> None:
    """Someone ends every run with ``echo 1 > <parent>/cgroup.kill``: the kernel then kills every child
    cloned into the spare leaves made before it, at birth. The next creates are born alive in them (each
    made again under its name), not killed (found in review)."""
    async with open_containment("cgroup", state_dir=str(tmp_path)) as chosen:
        assert isinstance(chosen, CgroupContainment)
        async with open_supervisor(containment=chosen, grace_seconds=0.2) as sup:
            first = await sup.spawn(SpawnSpec(argv=("true",)))
            await first.wait()
            with trio.fail_after(5):
                while len(_spares(chosen.cgroup.path)) < chosen.pool.size:  # made after the run
                    await trio.sleep(0.01)
            doomed = await sup.spawn(SpawnSpec(argv=("sleep", "30")))
            Path(chosen.cgroup.path, "cgroup.kill").write_text("1")
            with trio.fail_after(10):
                assert (await doomed.wait()).signal == signal.SIGKILL
            for n in range(4):  # the spare leaves first, then new ones
                after = await sup.spawn(SpawnSpec(argv=("sleep", "30")))
                await trio.sleep(0.2)
                assert after.exit is None, (n, after.exit)  # alive: not killed at its birth
                await sup.cancel(after, force=True)


async def test_a_frozen_leaf_refuses_the_spawn_and_the_engine_goes_on(tmp_path: Path) -> None:
    """A run (the engine user's) or an operator freezes the engine's parent, or a spare leaf: a child
    cloned there would never reach its exec, and the clone would hold the engine's thread in the kernel.
    The create fails at once, says why, and the next one after the thaw lives (found by a new user)."""
    async with open_containment("cgroup", state_dir=str(tmp_path)) as chosen:
        assert isinstance(chosen, CgroupContainment)
        freeze = Path(chosen.cgroup.path, "cgroup.freeze")
        async with open_supervisor(containment=chosen, grace_seconds=0.2) as sup:
            freeze.write_text("1")
            # Should the spawn go ahead, the clone holds this thread in the kernel: thawed from a timer
            # thread, so that the test fails instead of hanging the suite.
            thaw = threading.Timer(10, lambda: freeze.write_text("0"))
            thaw.start()
            try:
                with trio.fail_after(5), pytest.raises(OSError, match="is frozen"):
                    await sup.spawn(SpawnSpec(argv=("sleep", "30")))
            finally:
                thaw.cancel()
                freeze.write_text("0")
            after = await sup.spawn(SpawnSpec(argv=("sleep", "30")))
            await trio.sleep(0.2)
            assert after.exit is None and after.cgroup is not None
            await sup.cancel(after, force=True)
