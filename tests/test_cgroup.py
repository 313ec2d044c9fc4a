"""The cgroup v2 layer: finding the hierarchy, the parent, leaves, spawning into a leaf, waiting for it."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest
import trio

from engine._cgroup import (
    PARENT_RECORD,
    EngineCgroup,
    find_cgroup2,
    load_recorded_parent,
    parent_name,
)
from engine._cgroup_watch import open_leaf_watcher
from engine._errors import SpawnError
from engine._spawn import spawn_process

_FOUND, _WHY = find_cgroup2()


def _usable() -> str:
    if _FOUND is None:
        return _WHY
    if not os.access(_FOUND.own, os.W_OK):
        return f"the cgroup {_FOUND.own} is not writable by uid {os.getuid()}"
    return ""


needs_cgroup = pytest.mark.skipif(bool(_usable()), reason=f"no writable cgroup v2: {_usable()}")


def _own_cgroup() -> str:
    return next(line for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::"))


def _spawn(argv: list[str], cwd: str, cgroup_fd: int | None = None) -> int:
    return spawn_process(
        argv, cwd=cwd, env=dict(os.environ), stdout_fd=None, stderr_fd=None, cgroup_fd=cgroup_fd
    )


def test_parent_is_named_after_the_state_dir_and_recorded(tmp_path: Path) -> None:
    assert parent_name(str(tmp_path)) == parent_name(str(tmp_path) + "/")
    assert parent_name(str(tmp_path)) != parent_name(str(tmp_path / "other"))
    if _usable():
        pytest.skip(f"no writable cgroup v2: {_usable()}")
    assert _FOUND is not None
    cgroup = EngineCgroup.open(_FOUND, str(tmp_path))
    try:
        assert os.path.basename(cgroup.path) == parent_name(str(tmp_path))
        loaded = load_recorded_parent(str(tmp_path))
        assert loaded is not None and loaded[1] == cgroup.path
    finally:
        cgroup.close()
    assert not os.path.exists(cgroup.path)


@needs_cgroup
def test_a_leaf_is_made_after_its_parent_was_removed_from_under_the_engine(parent: EngineCgroup) -> None:
    """The guardian of a crashed engine of the same state directory removes the parent it finds empty,
    maybe just after a new engine opened it: the next leaf makes the parent again."""
    os.rmdir(parent.path)
    leaf = parent.leaf("r1-test")
    assert os.path.isdir(leaf.path) and os.path.dirname(leaf.path) == parent.path
    assert leaf.remove()


@needs_cgroup
def test_a_planted_parent_record_is_not_trusted(tmp_path: Path) -> None:
    assert _FOUND is not None
    (tmp_path / PARENT_RECORD).write_text(_FOUND.own + "\n")  # somebody else's cgroup
    assert load_recorded_parent(str(tmp_path)) is None
    (tmp_path / PARENT_RECORD).unlink()
    os.symlink("/etc/passwd", tmp_path / PARENT_RECORD)
    assert load_recorded_parent(str(tmp_path)) is None


@needs_cgroup
async def test_a_child_is_born_in_its_leaf_and_the_engine_goes_home(
    parent: EngineCgroup, tmp_path: Path
) -> None:
    before = _own_cgroup()
    leaf = parent.leaf("r1-test")
    pid = parent.spawn_in(leaf, lambda fd: _spawn(["sleep", "30"], str(tmp_path), fd))
    try:
        assert _own_cgroup() == before
        assert leaf.holds(pid) and leaf.procs() == [pid] and leaf.populated()
    finally:
        leaf.kill()
        os.waitpid(pid, 0)
    assert not leaf.populated() and leaf.remove()


@needs_cgroup
def test_a_spawn_error_stays_a_spawn_error_and_the_engine_goes_home(
    parent: EngineCgroup, tmp_path: Path
) -> None:
    before = _own_cgroup()
    leaf = parent.leaf("r2-test")
    with pytest.raises(SpawnError, match="command not found"):
        parent.spawn_in(leaf, lambda fd: _spawn(["definitely-not-a-command-308"], str(tmp_path), fd))
    assert _own_cgroup() == before
    assert not leaf.populated() and leaf.remove()


@needs_cgroup
async def test_a_scrubbed_double_forked_daemon_cannot_leave_its_leaf(
    parent: EngineCgroup, tmp_path: Path
) -> None:
    leaf = parent.leaf("r3-test")
    script = "setsid -f env -i sleep 7771.25; exec sleep 7771.5"
    pid = parent.spawn_in(leaf, lambda fd: _spawn(["bash", "-c", script], str(tmp_path), fd))

    def scrubbed_daemon() -> int | None:  # the sleep that env -i started: before its exec it is setsid's
        for p in leaf.procs():
            with contextlib.suppress(OSError):
                if p != pid and Path(f"/proc/{p}/cmdline").read_bytes() == b"sleep\x007771.25\x00":
                    return p
        return None

    async with open_leaf_watcher() as watcher:
        with trio.fail_after(5):
            while (daemon := scrubbed_daemon()) is None:
                await trio.sleep(0.01)
        assert b"GADGET" not in Path(f"/proc/{daemon}/environ").read_bytes()
        leaf.signal(signal.SIGINT)  # sleep dies of SIGINT: both go
        with trio.fail_after(5):
            await watcher.wait_empty(leaf)
    assert (
        not os.path.exists(f"/proc/{daemon}/cmdline")
        or Path(f"/proc/{daemon}/stat").read_text().split()[2] in "ZX"
    )
    os.waitpid(pid, 0)
    assert leaf.remove()


@needs_cgroup
async def test_cgroup_kill_ends_what_ignores_sigint(parent: EngineCgroup, tmp_path: Path) -> None:
    leaf = parent.leaf("r4-test")
    pid = parent.spawn_in(
        leaf, lambda fd: _spawn(["bash", "-c", "trap '' INT; sleep 7772.5 & wait"], str(tmp_path), fd)
    )
    async with open_leaf_watcher() as watcher:
        with trio.fail_after(5):
            while len(leaf.procs()) < 2:
                await trio.sleep(0.01)
        leaf.signal(signal.SIGINT)
        with trio.move_on_after(0.3) as waited:
            await watcher.wait_empty(leaf)
        assert waited.cancelled_caught  # bash ignores SIGINT and its & job too
        leaf.kill()
        with trio.fail_after(5):
            await watcher.wait_empty(leaf)
    os.waitpid(pid, 0)
    assert leaf.zombie_children(os.getpid()) == []
    assert leaf.remove()


@pytest.mark.serial  # a time bound: measured alone (make test runs the rest two at a time)
@needs_cgroup
async def test_leaf_events_nobody_waits_for_are_read_late_and_a_waiter_is_still_woken_at_once(
    parent: EngineCgroup, tmp_path: Path
) -> None:
    """The watcher reads the events of leaves nobody waits on only ``IDLE_READ_SECONDS`` after they came
    (a ``kill_all``'s thousands are not parsed in the middle of its kills), and at once when a task waits:
    a leaf emptied while the others' events are queued wakes its waiter without that delay."""
    from engine._cgroup_watch import IDLE_READ_SECONDS

    leaves = [parent.leaf(f"r{5 + i}-test") for i in range(12)]
    pids = [
        parent.spawn_in(leaf, lambda fd: _spawn(["sleep", "7773.5"], str(tmp_path), fd)) for leaf in leaves
    ]
    try:
        async with open_leaf_watcher() as watcher:
            seen = [watcher.generation(leaf) for leaf in leaves]
            for leaf in leaves[:-1]:
                leaf.kill()
            with trio.fail_after(5):
                while any(leaf.populated() for leaf in leaves[:-1]):
                    await trio.sleep(0.005)
            await trio.sleep(0.02)  # the reader had its chance: nobody waits, nothing is read yet
            assert [watcher.generation(leaf) for leaf in leaves] == seen
            t0 = trio.current_time()
            with trio.fail_after(5):
                await watcher.wait_changed(leaves[0], seen[0])  # its event is queued: read now
            assert trio.current_time() - t0 < IDLE_READ_SECONDS / 2
            assert all(watcher.generation(leaf) > g for leaf, g in zip(leaves[:-1], seen[:-1], strict=True))
            last = leaves[-1]
            since = watcher.generation(last)

            async def empty_later() -> None:
                await trio.sleep(0.05)
                last.kill()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(empty_later)
                t0 = trio.current_time()
                with trio.fail_after(5):
                    await watcher.wait_changed(last, since)
            assert trio.current_time() - t0 < 0.05 + IDLE_READ_SECONDS / 2
            assert not last.populated()
    finally:
        for leaf in leaves:
            leaf.kill()
        for pid in pids:
            os.waitpid(pid, 0)
    assert all(leaf.remove() for leaf in leaves)
