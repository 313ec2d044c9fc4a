"""The log cap looks only at logs written since its last look (``engine/_logwatch.py``, issue 19).

Idle children cost the cap nothing; a log that wakes up after a quiet while is capped at the next look;
a write through another name of the file (a hard link the child made elsewhere) is seen too, since the
watch is on the inode the engine made.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
import trio

from engine._logs import LogFile
from engine._logwatch import LogWatch, open_log_watch

from .service_support import engine_at, make_project

MiB = 2**20


def test_log_watch_reports_one_write_per_arming(tmp_path: Path) -> None:
    watch: LogWatch[str] | None = open_log_watch()
    if watch is None:
        pytest.skip("inotify is not available here: the cap polls every log instead")
    log = tmp_path / "a.log"
    log.write_bytes(b"")
    try:
        fd = os.open(log, os.O_RDONLY)
        try:
            assert watch.arm(fd, "a")
        finally:
            os.close(fd)
        assert watch.take() == (set(), False)
        with open(log, "ab") as f:
            f.write(b"one\n")
            f.flush()
            f.write(b"two\n")
        assert watch.take() == ({"a"}, False)
        with open(log, "ab") as f:  # the watch is spent until armed again
            f.write(b"three\n")
        assert watch.take() == (set(), False)
    finally:
        watch.close()


async def _allocated_within(path: str, limit: int, seconds: float) -> int:
    """Wait until the file holds 4 MiB, then (within ``seconds``) until at most ``limit`` is allocated."""
    with trio.fail_after(10):
        while os.stat(path).st_size < 4 * MiB:
            await trio.sleep(0.05)
    with trio.move_on_after(seconds):
        while os.stat(path).st_blocks * 512 > limit:
            await trio.sleep(0.05)
    return os.stat(path).st_blocks * 512


async def test_a_log_written_after_a_quiet_while_is_capped_at_the_next_look(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    go = tmp_path / "go"
    script = f"while [ ! -e {go} ]; do sleep 0.05; done; head -c {4 * MiB} /dev/zero; exec sleep 60"
    async with engine_at(tmp_path, log_cap_bytes=MiB) as engine:
        sp = await engine.service.create(project, "sh", ["-c", script])
        await trio.sleep(2.5)  # looked at (and armed) once, then quiet
        go.touch()
        allocated = await _allocated_within(sp.stdout_path, MiB + 64 * 1024, 5.0)
        assert allocated <= MiB + 64 * 1024, allocated
        await engine.service.kill_subprocess(sp)


async def test_a_write_through_a_hard_link_elsewhere_is_capped_too(tmp_path: Path) -> None:
    project = make_project(tmp_path)
    go, elsewhere = tmp_path / "go", tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = elsewhere / "alias.log"
    script = f"while [ ! -e {go} ]; do sleep 0.05; done; head -c {4 * MiB} /dev/zero >> {link}; exec sleep 60"
    async with engine_at(tmp_path, log_cap_bytes=MiB) as engine:
        sp = await engine.service.create(project, "sh", ["-c", script])
        await trio.sleep(2.5)
        os.link(sp.stdout_path, link)  # a hard link, as the child itself could make one
        go.touch()
        allocated = await _allocated_within(sp.stdout_path, MiB + 64 * 1024, 5.0)
        assert allocated <= MiB + 64 * 1024, allocated
        await engine.service.kill_subprocess(sp)


async def test_idle_children_cost_the_cap_no_look(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    probe: LogWatch[str] | None = open_log_watch()
    if probe is None:
        pytest.skip("inotify is not available here: the cap polls every log instead")
    probe.close()
    looks: list[str] = []
    real = LogFile.enforce_cap

    def counted(self: LogFile, cap_bytes: int, **kw: object) -> int:
        looks.append(self.path)
        return real(self, cap_bytes, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(LogFile, "enforce_cap", counted)
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        sps = [await engine.service.create(project, "sleep", ["60"]) for _ in range(20)]
        await trio.sleep(1.5)  # the first look at each new child's logs
        assert len(looks) == 40
        looks.clear()
        await trio.sleep(3.2)
        assert looks == []  # nothing written: nothing looked at
        assert engine.service._capper is not None  # still running while children live
        for sp in sps:
            await engine.service.kill_subprocess(sp)


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Record the time of each read of the cap's inotify descriptor (``LogWatch.take``): one per look."""
    probe: LogWatch[str] | None = open_log_watch()
    if probe is None:
        pytest.skip("inotify is not available here: the cap polls every log instead")
    probe.close()
    reads: list[float] = []
    real = LogWatch.take

    def counted(self: LogWatch[LogFile]) -> tuple[set[LogFile], bool]:
        reads.append(trio.current_time())
        return real(self)

    monkeypatch.setattr(LogWatch, "take", counted)
    return reads


async def test_an_idle_engine_s_log_cap_does_not_wake(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Children that write nothing: the cap waits on its inotify descriptor and reads it not once."""
    reads = _count_reads(monkeypatch)
    project = make_project(tmp_path)
    async with engine_at(tmp_path) as engine:
        sps = [await engine.service.create(project, "sleep", ["60"]) for _ in range(20)]
        await trio.sleep(1.5)  # the first look at the new children's logs
        assert len(reads) == 1
        reads.clear()
        await trio.sleep(3.2)
        assert reads == []  # no write, no look, no wake: not even a read of the descriptor
        assert engine.service._capper is not None  # still waiting while children live
        for sp in sps:
            await engine.service.kill_subprocess(sp)


async def test_a_write_after_a_quiet_while_is_capped_within_two_seconds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = _count_reads(monkeypatch)
    project = make_project(tmp_path)
    go = tmp_path / "go"
    script = f"while [ ! -e {go} ]; do sleep 0.05; done; head -c {4 * MiB} /dev/zero; exec sleep 60"
    async with engine_at(tmp_path, log_cap_bytes=MiB) as engine:
        sp = await engine.service.create(project, "sh", ["-c", script])
        await trio.sleep(3.0)  # looked at (and armed) once, then quiet
        assert len(reads) == 1
        go.touch()
        allocated = await _allocated_within(sp.stdout_path, MiB + 64 * 1024, 2.0)
        assert allocated <= MiB + 64 * 1024, allocated
        await engine.service.kill_subprocess(sp)


async def test_a_busy_log_is_looked_at_once_a_second_at_most(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child writing all the time keeps the descriptor readable: the cap still looks once a second."""
    reads = _count_reads(monkeypatch)
    project = make_project(tmp_path)
    async with engine_at(tmp_path, log_cap_bytes=MiB) as engine:
        sp = await engine.service.create(project, "sh", ["-c", "while :; do echo tick; sleep 0.01; done"])
        await trio.sleep(4.5)
        gaps = [b - a for a, b in itertools.pairwise(reads)]
        assert 3 <= len(reads) <= 5, reads
        assert all(gap >= 0.99 for gap in gaps), gaps
        assert all(gap <= 1.5 for gap in gaps), gaps  # each write looked at within about a second
        await engine.service.kill_subprocess(sp)
