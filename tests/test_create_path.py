"""The create path made lighter (issue 19): what each shortcut must still guarantee.

A cgroup leaf is watched (inotify) only once its tree needs it, and a leader's leftovers are still seen
leaving; the project directory is looked at only when its log folder cannot be used, with the same
"bad cwd" error; the limits are counted only when the records could reach one, kept ones never counting.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import trio

from engine import LimitExceededError, SpawnError, SpawnSpec, open_supervisor
from engine._containment import CgroupContainment

from .children import mark, pgrep
from .service_support import engine_at, make_project


@pytest.mark.usefixtures("needs_cgroup")
async def test_a_run_whose_leaf_empties_with_its_leader_is_never_watched() -> None:
    async with open_supervisor(containment="cgroup") as sup:
        containment = sup.containment
        assert isinstance(containment, CgroupContainment)
        watcher = containment.watcher
        for _ in range(3):
            run = await sup.spawn(SpawnSpec(argv=("true",)))
            assert (await run.wait()).exit_code == 0
        assert repr(watcher) == "<LeafWatcher 0 leaves watched>"


@pytest.mark.usefixtures("needs_cgroup")
async def test_a_leaders_leftover_in_its_leaf_is_seen_leaving_without_an_eager_watch() -> None:
    """The leaf gets its watch at the first look after the leader's exit: the leftover's exit (well
    before the grace period) still ends the run at once."""
    marker = mark("0.4")
    async with open_supervisor(containment="cgroup", grace_seconds=20.0) as sup:
        started = time.monotonic()
        run = await sup.spawn(SpawnSpec(argv=("sh", "-c", f"sleep {marker} & exit 3")))
        with trio.fail_after(10):
            exit = await run.wait()
        took = time.monotonic() - started
        assert exit.exit_code == 3 and not exit.escalated
        assert 0.4 <= took < 5.0, took  # ended by the leftover's exit, not by the grace period
        assert not pgrep(marker)


async def test_create_in_a_project_directory_removed_since_the_last_create_is_bad_cwd(
    tmp_path: Path, containment: str
) -> None:
    project = make_project(tmp_path)
    async with engine_at(tmp_path, containment=containment) as engine:
        sp = await engine.service.create(project, "true")
        await sp.wait()
        await engine.service.kill_all()
        shutil.rmtree(project.directory)  # the log folder was walked and is cached: the check finds it gone
        with pytest.raises(SpawnError, match="does not exist") as caught:
            await engine.service.create(project, "true")
        assert caught.value.reason == "bad cwd"
        assert engine.service.ps() == []
    assert not os.path.exists(project.directory)


async def test_create_where_the_project_directory_became_a_file_is_bad_cwd(
    tmp_path: Path, containment: str
) -> None:
    project = make_project(tmp_path)
    os.rmdir(project.directory)
    Path(project.directory).write_text("not a folder")
    async with engine_at(tmp_path, containment=containment) as engine:
        with pytest.raises(SpawnError, match="not a directory") as caught:
            await engine.service.create(project, "true")
        assert caught.value.reason == "bad cwd"
        assert engine.service.ps() == []
    assert Path(project.directory).read_text() == "not a folder"


async def test_kept_records_never_count_against_the_limits(tmp_path: Path, containment: str) -> None:
    project = make_project(tmp_path)
    async with engine_at(
        tmp_path, containment=containment, max_processes_per_project=2, max_processes=3
    ) as engine:
        for _ in range(4):  # more kept records than either limit
            sp = await engine.service.create(project, "true")
            await sp.wait()
        marker = mark("311.2")
        live = [await engine.service.create(project, "sleep", [marker]) for _ in range(2)]
        with pytest.raises(LimitExceededError, match="max_processes_per_project"):
            await engine.service.create(project, "sleep", [marker])
        other = make_project(tmp_path, "other")
        live.append(await engine.service.create(other, "sleep", [marker]))
        with pytest.raises(LimitExceededError, match="max_processes "):
            await engine.service.create(other, "sleep", [marker])
        assert len(pgrep(marker)) == 3
        await engine.service.kill_all()
    assert not pgrep(marker)
