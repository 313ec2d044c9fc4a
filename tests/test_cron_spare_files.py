"""Spent exit records kept as spare files for the next logs (``_spare_files``): real files, real inodes."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from engine.cron import OnExit, SystemEvent
from engine.cron._spare_files import SPARE_FOLDER, SpareFiles

from .watch_support import engine_with, wait_events, wait_until

FLAGS = os.O_WRONLY | os.O_APPEND


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    made = tmp_path / "watch-logs"
    made.mkdir(mode=0o700)
    return made


def _take(spares: SpareFiles, folder: Path, name: str) -> int | None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return spares.take(name, fd, FLAGS)
    finally:
        os.close(fd)


def test_a_retired_record_becomes_the_next_log_emptied_with_its_inode(folder: Path) -> None:
    record = folder / "j.a.exit.json"
    record.write_text('{"pid": 1, "exit_code": 0}')
    inode = record.stat().st_ino
    spares = SpareFiles(str(folder))
    assert spares.retire(str(record))
    assert not record.exists()
    spare_folder = folder / SPARE_FOLDER
    assert stat.S_IMODE(spare_folder.stat().st_mode) == 0o700
    (kept,) = spare_folder.iterdir()
    assert kept.stat().st_size == 0  # emptied at once: what it said is gone
    fd = _take(spares, folder, "j.b.stdout.log")
    assert fd is not None
    try:
        os.write(fd, b"first\n")
        os.write(fd, b"second\n")
    finally:
        os.close(fd)
    log = folder / "j.b.stdout.log"
    assert (log.stat().st_ino, log.read_text()) == (inode, "first\nsecond\n")
    assert list(spare_folder.iterdir()) == []
    assert _take(spares, folder, "j.c.stdout.log") is None  # none left: the caller makes a new file


def test_spares_outlive_their_engine(folder: Path) -> None:
    record = folder / "j.a.exit.json"
    record.write_text("{}")
    assert SpareFiles(str(folder)).retire(str(record))
    again = SpareFiles(str(folder))  # the next engine's: lists .spare/ once
    fd = _take(again, folder, "j.b.stdout.log")
    assert fd is not None
    os.close(fd)
    record.write_text("{}")
    assert again.retire(str(record))  # a new name: the old spare's is not reused while it is there
    assert len(list((folder / SPARE_FOLDER).iterdir())) == 1


def test_what_is_not_a_lone_regular_file_of_ours_is_not_retired(folder: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me\n")
    os.link(outside, folder / "hardlink.exit.json")
    os.symlink(outside, folder / "link.exit.json")
    os.mkfifo(folder / "fifo.exit.json")
    (folder / "dir.exit.json").mkdir()
    names = ["hardlink", "link", "fifo", "dir", "missing"]
    if os.geteuid() == 0:  # a device at the record's name: looked at, not opened
        os.mknod(folder / "dev.exit.json", 0o600 | stat.S_IFCHR, os.stat("/dev/null").st_rdev)
        names.append("dev")
    spares = SpareFiles(str(folder))
    for name in names:
        assert not spares.retire(str(folder / f"{name}.exit.json")), name
    assert outside.read_text() == "keep me\n"
    assert not (folder / SPARE_FOLDER).exists()  # nothing kept: no folder made


def test_no_more_than_the_limit_are_kept(folder: Path) -> None:
    spares = SpareFiles(str(folder), limit=2)
    kept = []
    for n in range(3):
        record = folder / f"j.{n}.exit.json"
        record.write_text("{}")
        kept.append(spares.retire(str(record)))
    assert kept == [True, True, False]
    assert (folder / "j.2.exit.json").exists()  # the caller removes it, as before


def test_what_a_command_plants_among_the_spares_is_never_followed_nor_written(
    folder: Path, tmp_path: Path
) -> None:
    """A watched command runs as the engine's user and may put anything in ``.spare/``: a link, a hard
    link to another file, a FIFO, a folder, a file with content. None is written through nor emptied
    (a hard link loses only its name in ``.spare/``); a spare with content is emptied."""
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me\n")
    spare_folder = folder / SPARE_FOLDER
    spare_folder.mkdir(mode=0o700)
    os.symlink(outside, spare_folder / "s0")
    os.link(outside, spare_folder / "s1")
    os.mkfifo(spare_folder / "s2")
    (spare_folder / "s3").mkdir()
    (spare_folder / "s3" / "inside").write_text("x")  # found by a fresh tester: a folder with content stayed
    (spare_folder / "s4").write_text("old output\n")
    if os.geteuid() == 0:  # a device: looked at, never opened
        os.mknod(spare_folder / "s5", 0o600 | stat.S_IFCHR, os.stat("/dev/null").st_rdev)
    spares = SpareFiles(str(folder))
    taken: list[int] = []
    while (fd := _take(spares, folder, f"j.{len(taken)}.stdout.log")) is not None:
        taken.append(fd)
        os.write(fd, b"new\n")
        os.close(fd)
    assert [(folder / f"j.{n}.stdout.log").read_text() for n in range(len(taken))] == ["new\n"]
    assert outside.read_text() == "keep me\n" and os.stat(outside).st_nlink == 1
    assert list(spare_folder.iterdir()) == []


def test_a_spare_replaces_a_link_at_the_logs_name_without_following_it(folder: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me\n")
    record = folder / "j.a.exit.json"
    record.write_text("{}")
    spares = SpareFiles(str(folder))
    assert spares.retire(str(record))
    os.symlink(outside, folder / "j.b.stdout.log")
    (folder / "j.c.stdout.log").mkdir()
    assert _take(spares, folder, "j.c.stdout.log") is None  # a folder there: not replaced, still a spare
    fd = _take(spares, folder, "j.b.stdout.log")
    assert fd is not None
    os.write(fd, b"mine\n")
    os.close(fd)
    assert outside.read_text() == "keep me\n"
    assert stat.S_ISREG((folder / "j.b.stdout.log").lstat().st_mode)
    assert (folder / "j.b.stdout.log").read_text() == "mine\n"


async def test_a_fired_jobs_exit_record_becomes_the_next_commands_log(tmp_path: Path) -> None:
    """Through the engine: a fired job's exit record is not freed (on an ext4 without a journal a freed
    inode slows the next minutes' files near it) but kept, and the next watched command's log is it."""
    state = tmp_path / "s"
    spare_folder = state / "watch-logs" / SPARE_FOLDER
    async with engine_with(state) as engine:
        await engine.cron.add(OnExit(command="exit 3"), SystemEvent("first"))
        (event,) = await wait_events(engine, 1)
        assert event.exit_code == 3
        await wait_until(lambda: spare_folder.exists() and len(list(spare_folder.iterdir())) == 1)
        (spare,) = spare_folder.iterdir()
        inode = spare.stat().st_ino
        job = await engine.cron.add(OnExit(command="echo second; sleep 30"), SystemEvent("second"))
        logs = state / "watch-logs"
        await wait_until(lambda: any(p.name.startswith(job.id) for p in logs.iterdir()))
        (stdout,) = [p for p in logs.iterdir() if p.name.startswith(job.id) and p.name.endswith("stdout.log")]
        assert stdout.stat().st_ino == inode
        await wait_until(lambda: stdout.read_text() == "second\n")
        assert list(spare_folder.iterdir()) == []
        await engine.cron.remove(job.id)


@pytest.mark.parametrize("mode", [0o664, 0o4755, 0o000])
def test_a_spare_becomes_a_log_of_mode_0600_whatever_its_mode_was(folder: Path, mode: int) -> None:
    """Found by a fresh tester: the Perl shim makes the record under the umask (0664 with umask 002), and a
    log made from it kept that mode, which the fire's read then refused ("writable by group"); a planted
    spare kept a setuid bit."""
    record = folder / "j.a.exit.json"
    record.write_text("{}")
    os.chmod(record, mode)
    spares = SpareFiles(str(folder))
    assert spares.retire(str(record))
    fd = _take(spares, folder, "j.b.stdout.log")
    assert fd is not None
    os.close(fd)
    assert stat.S_IMODE((folder / "j.b.stdout.log").stat().st_mode) == 0o600
