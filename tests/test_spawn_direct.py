"""The compiled spawn (``_spawn_direct``): the same child as glibc's ``posix_spawn`` gives, the same errors,
and in cgroup containment the child born in its leaf without the engine ever leaving its own cgroup."""

from __future__ import annotations

import errno
import os
import platform
import shutil
import signal
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from engine import SpawnError, SpawnSpec, _spawn_direct, open_supervisor
from engine._cgroup import EngineCgroup, find_cgroup2
from engine._procfs import engine_children
from engine._spawn import (
    CgroupKilledAtBirthError,
    CgroupSpawnRefusedError,
    spawn_process,
    spawns_into_cgroup,
    start_time_of,
)

from .children import open_fds

_FOUND, _WHY = find_cgroup2()
_CGROUP_OK = _FOUND is not None and os.access(_FOUND.own, os.W_OK)
needs_cgroup = pytest.mark.skipif(not _CGROUP_OK, reason=f"no writable cgroup v2: {_WHY}")
needs_compiled = pytest.mark.skipif(
    _spawn_direct.direct_spawn() is None,
    reason="the compiled spawn is not built here (no C compiler at install, or not x86-64)",
)


@pytest.fixture(params=["compiled", "posix_spawn"])
def path_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each spawn path in turn: the compiled one (skipped where it is not built) and glibc's."""
    if request.param == "compiled":
        if _spawn_direct.direct_spawn() is None:
            pytest.skip("the compiled spawn is not built here")
    else:
        monkeypatch.setattr(_spawn_direct, "_off", True)
    yield request.param


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def _stat_fields(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _reap(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def test_the_child_gets_the_same_clean_slate_on_either_path(path_kind: str, tmp_path: Path) -> None:
    out = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    stray = os.open(tmp_path / "stray", os.O_WRONLY | os.O_CREAT, 0o600)  # not close-on-exec: must not leak
    old = signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # an ignored signal the child must not inherit
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    try:
        pid = spawn_process(
            ["sleep", "30"],
            cwd=str(tmp_path),
            env={"ONLY": "this", "PATH": os.environ["PATH"]},
            stdout_fd=out,
            stderr_fd=None,
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        signal.signal(signal.SIGUSR1, old)
        os.close(stray)
        os.close(out)
    try:
        deadline = time.monotonic() + 5
        while _stat_fields(pid)[0] != "S":  # asleep: its exec is over (environ is set late in it)
            assert time.monotonic() < deadline
            time.sleep(0.005)
        status = _status(pid)
        assert int(status["SigIgn"], 16) & (1 << (signal.SIGUSR1 - 1)) == 0
        assert int(status["SigBlk"], 16) == 0
        fields = _stat_fields(pid)
        assert int(fields[3]) == pid and int(fields[2]) == pid  # session and group leader
        assert sorted(os.listdir(f"/proc/{pid}/fd")) == ["0", "1", "2"]
        assert os.readlink(f"/proc/{pid}/fd/0") == "/dev/null"
        assert os.readlink(f"/proc/{pid}/fd/1") == str(tmp_path / "out")
        assert os.readlink(f"/proc/{pid}/fd/2") == "/dev/null"
        assert os.readlink(f"/proc/{pid}/cwd") == str(tmp_path)
        assert Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")[:-1] == [
            b"ONLY=this",
            b"PATH=" + os.environ["PATH"].encode(),
        ]
    finally:
        _reap(pid)


def test_a_descriptor_below_three_is_handed_over_whatever_the_order(path_kind: str, tmp_path: Path) -> None:
    """The child's stdout is the engine's fd 0 and its stdin the engine's fd 1 (the first step must not
    overwrite what a later one copies)."""
    saved = (os.dup(0), os.dup(1))
    a = os.open(tmp_path / "a", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    b = os.open(tmp_path / "b", os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.dup2(a, 0)
        os.dup2(b, 1)
        pid = spawn_process(
            ["sleep", "30"], cwd=str(tmp_path), env=dict(os.environ), stdout_fd=0, stderr_fd=1, stdin_fd=1
        )
    finally:
        os.dup2(saved[0], 0)
        os.dup2(saved[1], 1)
        for fd in (*saved, a, b):
            os.close(fd)
    try:
        assert os.readlink(f"/proc/{pid}/fd/0") == str(tmp_path / "b")
        assert os.readlink(f"/proc/{pid}/fd/1") == str(tmp_path / "a")
        assert os.readlink(f"/proc/{pid}/fd/2") == str(tmp_path / "b")
    finally:
        _reap(pid)


@pytest.mark.parametrize(
    ("command", "err", "reason"),
    [
        ("definitely-not-a-command-308", errno.ENOENT, "command not found"),
        ("./script.sh", errno.EACCES, "permission denied"),
        ("./subdir", errno.EACCES, "is a directory"),
        ("./bad-interp.sh", errno.ENOENT, "bad interpreter"),
        ("./garbage", errno.ENOEXEC, "exec format error"),
    ],
)
def test_an_exec_failure_is_a_typed_error_and_leaves_no_child(
    path_kind: str, tmp_path: Path, command: str, err: int, reason: str
) -> None:
    (tmp_path / "script.sh").write_text("#!/bin/sh\necho hi\n")
    (tmp_path / "subdir").mkdir()
    (tmp_path / "bad-interp.sh").write_text("#!/nonexistent/interpreter\necho hi\n")
    (tmp_path / "bad-interp.sh").chmod(0o755)
    (tmp_path / "garbage").write_bytes(b"\x7fELF\x00garbage")
    (tmp_path / "garbage").chmod(0o755)
    children, fds = engine_children(), open_fds()
    with pytest.raises(SpawnError) as info:
        spawn_process([command], cwd=str(tmp_path), env=dict(os.environ), stdout_fd=None, stderr_fd=None)
    assert (info.value.errno, info.value.reason) == (err, reason)
    assert engine_children() <= children  # the failed child was reaped: no zombie left behind
    assert open_fds() == fds


def test_a_bad_cwd_is_said_as_such(path_kind: str, tmp_path: Path) -> None:
    with pytest.raises(SpawnError) as info:
        spawn_process(
            ["/bin/true"], cwd=str(tmp_path / "gone"), env=dict(os.environ), stdout_fd=None, stderr_fd=None
        )
    assert info.value.reason == "bad cwd"


def test_a_nul_byte_in_an_argument_is_refused(path_kind: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="argv must not hold a NUL byte"):
        spawn_process(["/bin/echo", "a\0b"], cwd=str(tmp_path), env={}, stdout_fd=None, stderr_fd=None)


def test_without_the_compiled_spawn_a_cgroup_descriptor_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(_spawn_direct, "_off", True)
    assert not spawns_into_cgroup()
    with pytest.raises(CgroupSpawnRefusedError):
        spawn_process(["/bin/true"], cwd=str(tmp_path), env={}, stdout_fd=None, stderr_fd=None, cgroup_fd=0)


@needs_cgroup
@needs_compiled
def test_the_child_is_born_in_its_leaf_and_the_engine_never_moves(
    parent: EngineCgroup, tmp_path: Path
) -> None:
    """With the compiled spawn the engine's own cgroup.procs is never written: a closed handle on it would
    make the move fail."""
    leaf = parent.leaf("r1-direct")
    home, parent._home_procs = parent._home_procs, -1
    try:
        pid = parent.spawn_in(
            leaf,
            lambda fd: spawn_process(
                ["sleep", "30"], cwd=str(tmp_path), env={}, stdout_fd=None, stderr_fd=None, cgroup_fd=fd
            ),
        )
    finally:
        parent._home_procs = home
    try:
        assert leaf.procs() == [pid] and leaf.holds(pid)
    finally:
        _reap(pid)
    assert leaf.remove()


@needs_cgroup
def test_the_child_is_born_in_its_leaf_on_the_posix_spawn_path_too(
    parent: EngineCgroup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_spawn_direct, "_off", True)
    before = Path("/proc/self/cgroup").read_text()
    leaf = parent.leaf("r2-moved")
    pid = parent.spawn_in(
        leaf,
        lambda fd: spawn_process(
            ["sleep", "30"], cwd=str(tmp_path), env={}, stdout_fd=None, stderr_fd=None, cgroup_fd=fd
        ),
    )
    try:
        assert leaf.procs() == [pid]
        assert Path("/proc/self/cgroup").read_text() == before
    finally:
        _reap(pid)
    assert leaf.remove()


@needs_cgroup
@needs_compiled
def test_a_leaf_removed_before_the_spawn_is_a_cgroup_error(parent: EngineCgroup, tmp_path: Path) -> None:
    leaf = parent.leaf("r3-gone")
    assert leaf.remove()
    children = engine_children()
    with pytest.raises(OSError, match="cannot enter the cgroup"):
        parent.spawn_in(
            leaf,
            lambda fd: spawn_process(
                ["/bin/true"], cwd=str(tmp_path), env={}, stdout_fd=None, stderr_fd=None, cgroup_fd=fd
            ),
        )
    assert engine_children() <= children


@needs_cgroup
@needs_compiled
def test_a_child_killed_at_birth_is_told_and_its_leaf_made_again(
    parent: EngineCgroup, tmp_path: Path
) -> None:
    """After a ``cgroup.kill`` (the leaf's own or, here, its parent's: someone ending the engine's runs),
    the kernel kills every child cloned into the leaf before it runs: the spawn says so and leaves
    nothing, and ``spawn_in`` makes the leaf again under its name and starts the child there."""
    leaf = parent.leaf("r4-killed")
    Path(parent.path, "cgroup.kill").write_text("1")
    children = engine_children()
    fd = os.open(leaf.path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(CgroupKilledAtBirthError, match="killed as it was born"):
            spawn_process(
                ["sleep", "30"], cwd=str(tmp_path), env={}, stdout_fd=None, stderr_fd=None, cgroup_fd=fd
            )
    finally:
        os.close(fd)
    assert engine_children() <= children  # reaped: no zombie
    pid = parent.spawn_in(
        leaf,
        lambda fd: spawn_process(
            ["sleep", "30"], cwd=str(tmp_path), env={}, stdout_fd=None, stderr_fd=None, cgroup_fd=fd
        ),
    )
    try:
        time.sleep(0.1)
        assert leaf.procs() == [pid]  # alive, in the leaf made again
    finally:
        _reap(pid)
    assert leaf.remove()


@needs_compiled
def test_the_library_is_loaded_only_when_nobody_else_can_write_it() -> None:
    info = os.lstat(_spawn_direct.LIBRARY)
    assert stat.S_ISREG(info.st_mode)
    assert not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


async def test_a_supervisor_run_is_contained_on_the_compiled_path(containment: str, tmp_path: Path) -> None:
    async with open_supervisor(grace_seconds=0.5, containment=containment) as sup:
        run = await sup.spawn(SpawnSpec(argv=("sleep", "30"), cwd=str(tmp_path)))
        if containment == "cgroup":
            assert run.cgroup is not None
            assert Path(f"{run.cgroup}/cgroup.procs").read_text().split() == [str(run.pid)]
        assert _stat_fields(run.pid)[3] == str(run.pid)
        with trio.fail_after(10):
            exit = await sup.cancel(run)
        assert exit.signal == signal.SIGINT


@needs_compiled
@pytest.mark.serial  # how often two clock readings straddle a tick depends on the load: measured alone
def test_the_start_time_told_without_proc_is_the_one_proc_shows(tmp_path: Path) -> None:
    told = 0
    for _ in range(50):
        pid = spawn_process(
            ["sleep", "30"], cwd=str(tmp_path), env=dict(os.environ), stdout_fd=None, stderr_fd=None
        )
        try:
            start = start_time_of(pid)
            if start is not None:
                told += 1
                assert start == int(_stat_fields(pid)[19])
        finally:
            _reap(pid)
        assert start_time_of(pid + 1) is None  # only the last child's is known
    assert told >= 25  # the clock readings straddle a tick in a few spawns out of a hundred


@needs_compiled
def test_a_library_of_another_build_is_not_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Called with arguments it does not take, a stale library would misreport; it is not used at all."""
    monkeypatch.setattr(_spawn_direct, "ABI", _spawn_direct.ABI + 1)
    _spawn_direct._load.cache_clear()
    try:
        assert _spawn_direct.direct_spawn() is None
        assert not spawns_into_cgroup()
    finally:
        monkeypatch.undo()
        _spawn_direct._load.cache_clear()
    assert _spawn_direct.direct_spawn() is not None


def test_the_compiled_spawn_is_built_wherever_a_c_compiler_is_found() -> None:
    compiler = os.environ.get("CC", "").strip() or next(
        (found for name in ("cc", "gcc", "clang") if (found := shutil.which(name))), None
    )
    if compiler is None or platform.machine() != "x86_64":
        pytest.skip("no C compiler on PATH, or not x86-64: the engine spawns through posix_spawn")
    assert os.path.exists(_spawn_direct.LIBRARY), (
        f"{_spawn_direct.LIBRARY} is missing although a C compiler is found: the install's build step "
        "(setup.py build_shim) failed; run `rm -f .venv/.installed-stamp; make setup` and read its warning"
    )
    assert _spawn_direct.direct_spawn() is not None, (
        f"{_spawn_direct.LIBRARY} is built but not loaded: it or its folder is writable by group or others, "
        "owned by another user, or left from another build (`rm -f .venv/.installed-stamp; make setup`)"
    )


@needs_compiled
@pytest.mark.parametrize("mode", [0o775, 0o757])
def test_a_library_others_can_write_is_not_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int
) -> None:
    planted = tmp_path / "_spawn_direct.bin"
    shutil.copy(_spawn_direct.LIBRARY, planted)
    monkeypatch.setattr(_spawn_direct, "LIBRARY", str(planted))
    monkeypatch.setattr(_spawn_direct, "_HERE", str(tmp_path))
    tmp_path.chmod(0o755)
    planted.chmod(0o755)
    try:
        _spawn_direct._load.cache_clear()
        assert _spawn_direct.direct_spawn() is not None  # the copy alone is fine
        planted.chmod(mode)
        _spawn_direct._load.cache_clear()
        assert _spawn_direct.direct_spawn() is None
        planted.chmod(0o755)
        tmp_path.chmod(0o777 | stat.S_ISVTX)  # a folder others can write to
        _spawn_direct._load.cache_clear()
        assert _spawn_direct.direct_spawn() is None
        tmp_path.chmod(0o755)
        link = tmp_path / "link"
        link.symlink_to(planted)
        monkeypatch.setattr(_spawn_direct, "LIBRARY", str(link))
        _spawn_direct._load.cache_clear()
        assert _spawn_direct.direct_spawn() is None  # a symbolic link is not followed
    finally:
        monkeypatch.undo()
        _spawn_direct._load.cache_clear()


@needs_compiled
@pytest.mark.serial  # how often a spawn's clock readings straddle a tick depends on the load
def test_the_start_time_told_is_the_spawning_threads_own(tmp_path: Path) -> None:
    """Two engines on two threads of one host never read each other's last start time."""
    for _ in range(100):
        pid = spawn_process(
            ["sleep", "30"], cwd=str(tmp_path), env=dict(os.environ), stdout_fd=None, stderr_fd=None
        )
        try:
            if start_time_of(pid) is None:
                continue  # this spawn straddled a tick: nothing was kept
            seen: list[int | None] = []
            thread = threading.Thread(target=lambda pid=pid, seen=seen: seen.append(start_time_of(pid)))
            thread.start()
            thread.join()
            assert seen == [None]
            return
        finally:
            _reap(pid)
    pytest.fail("no spawn of 100 had its start time told without /proc")
